"""The engine core: requests in, one `step()` at a time (schedule, run, sample), outputs out. The offline `LLM`
and the HTTP server are both thin loops over it.

Steps overlap. `step()` schedules and queues step n+1 on the device before it reads step n's tokens, so the host's
work (scheduling, batch preparation, then appending step n's tokens, detokenising, stop checks and whatever the
caller does with the outputs) runs while the device computes step n+1. Step n+1's input ids are step n's sampled
ids, copied on the device. A request whose token in flight is its last by max_tokens (or the context) runs no more
and gives its pages back when step n+1 is scheduled, as without overlap. One that stops on step n's token (a stop
id or string, EOS) was scheduled in step n+1 too: that token is dropped when step n+1 is read, and its pages are
freed when it finishes, as an aborted request's are; the device runs step n+1 before anything queued later reuses
them. Only plain greedy tokens are taken on the device: a step with a request that samples on the host
(temperature, seed, logprobs, a grammar, which needs the previous token to mask the next) is read at once, so the
step after it is scheduled as without overlap. Each request's tokens are the same either way, as far as its
numbers do not depend on the rest of its batch (the extra step of a stopped request can change a later batch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import structlog
import torch

from engine.boot import MemoryReport, boot, check_split
from engine.cache.block_manager import BlockManager
from engine.config import EngineConfig
from engine.model.args import ModelArgs
from engine.model_runner import ExpertCounts, LaunchedStep, ModelRunner
from engine.parallel import RankGroup
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, TokenLogprob, output_budget
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# Whole steps failing this many times in a row mean the engine, not a request, is broken: it stops.
MAX_FAILED_STEPS = 3


@dataclass
class RequestOutput:
    """What one step did for one request. `text`, `token_ids` and `logprobs` are the request's so far; the lists
    are shared with the engine (not copied every step), so read them once the request has finished."""

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    new_text: str = ""  # what this step added to `text`
    new_token_ids: tuple[int, ...] = ()
    new_logprobs: tuple[TokenLogprob, ...] = ()
    error: str | None = None  # with finish_reason "error": what failed
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache instead of computed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class EngineLoad:
    """What the engine holds right now (tokens of whole pages), as its server publishes it after each step."""

    kv_capacity_tokens: int
    kv_used_tokens: int
    running: int
    waiting: int
    preemptions: int  # since boot
    prefix_queried_tokens: int  # prompt tokens looked up in the prefix cache, since boot
    prefix_hit_tokens: int  # ... and found there
    prefix_cached_pages: int  # pages cached prefixes hold now


@dataclass(frozen=True)
class EngineCapacity:
    """What the engine allocated at boot, as /server_info reports it: over several ranks, what can be admitted (the
    sum of the data-parallel ranks' pools; one copy of tensor-parallel ones) and each rank's GPU memory."""

    kv_capacity_tokens: int
    kv_pages: int
    kv_bytes_per_token: float
    per_sequence_state_bytes: int
    memory: MemoryReport  # rank 0's
    memory_per_rank: list[MemoryReport]
    # Requests at full context the pool holds at once (a request holds whole pages).
    max_concurrency_at_full_context: float


def context_length_of(config: EngineConfig) -> int:
    """The longest request: the configured context length, else the model's maximum."""
    max_positions = ModelArgs.from_model_dir(config.model).max_position_embeddings
    context_length = config.context_length or max_positions
    if context_length > max_positions:
        raise ValueError(f"context_length {context_length} exceeds the model's maximum {max_positions}")
    return context_length


class LLMEngine:
    """Over several ranks (tensor_parallel_size > 1) this is rank 0, which starts the others (engine/parallel.py);
    with data-parallel attention it holds a scheduler per rank (a replica: its own pool and request slots) and gives
    each new request to the least loaded. `close()` stops the other ranks."""

    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_args = ModelArgs.from_model_dir(config.model)
        self.context_length = context_length_of(config)
        self.tokenizer = Tokenizer.from_model_dir(config.model)
        if config.tensor_parallel_size > 1:
            check_split(config)
        self.ranks = RankGroup.start(config)
        try:
            self.booted = boot(config, self.context_length, self.ranks)
            self.runner = ModelRunner(self.booted, self.ranks)
            # Ready once every rank is: each reports its GPU memory.
            self.memory_per_rank = self.ranks.gather(self.booted.memory) if self.ranks else [self.booted.memory]
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise
        self.schedulers = [
            Scheduler(
                config,
                BlockManager(self.booted.num_pages, config.page_size, config.max_num_seqs, self.booted.snapshot_slots),
                partial(self.runner.release, replica=replica),
            )
            for replica in range(len(self.runner.planners))
        ]
        # One request alone must always fit its replica's pool, so no request grows past it (see scheduler.py).
        self.max_request_tokens = min(self.context_length, self.booted.num_pages * config.page_size)
        self.sequences: dict[str, Sequence] = {}
        self.in_flight: LaunchedStep | None = None  # the step on the device whose tokens are still to be read
        self.overlap = True  # False: read every step's tokens before the next is scheduled (tests compare the two)
        self.failed_steps = 0  # steps in a row that failed as a whole
        self.broken = False  # a step failed over several ranks: they no longer agree

    @property
    def scheduler(self) -> Scheduler:
        """The first replica's scheduler: the only one unless attention is data-parallel."""
        return self.schedulers[0]

    @property
    def kv_capacity_tokens(self) -> int:
        return sum(s.blocks.capacity_tokens for s in self.schedulers)

    def load(self) -> EngineLoad:
        return EngineLoad(
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_used_tokens=sum(s.blocks.used_tokens for s in self.schedulers),
            running=sum(len(s.running) for s in self.schedulers),
            waiting=sum(len(s.waiting) for s in self.schedulers),
            preemptions=sum(s.num_preemptions for s in self.schedulers),
            prefix_queried_tokens=sum(s.blocks.queried_tokens for s in self.schedulers),
            prefix_hit_tokens=sum(s.blocks.hit_tokens for s in self.schedulers),
            prefix_cached_pages=sum(s.blocks.cached_pages for s in self.schedulers),
        )

    def capacity(self) -> EngineCapacity:
        booted, replicas = self.booted, len(self.schedulers)
        full_context = booted.num_pages / booted.layout.pages_for(self.context_length)
        return EngineCapacity(
            kv_capacity_tokens=self.kv_capacity_tokens,
            kv_pages=booted.num_pages * replicas,
            kv_bytes_per_token=booted.layout.bytes_per_token,
            per_sequence_state_bytes=booted.layout.per_sequence_state_bytes,
            memory=booted.memory,
            memory_per_rank=self.memory_per_rank,
            max_concurrency_at_full_context=round(full_context * replicas, 2),
        )

    def close(self) -> None:
        """Stop the other ranks (after the last step; killed where they are when a step failed): no process keeps a
        GPU."""
        if self.ranks is None:
            return
        if self.broken:
            self.ranks.kill()
        else:
            self.runner.synchronize()
            self.ranks.close()

    @property
    def expert_counts(self) -> ExpertCounts:
        """The routed experts each MoE layer read, counted on the device (read when scraped)."""
        return self.booted.expert_counts

    @property
    def applied_config(self) -> EngineConfig:
        """The configuration with every default resolved to what the engine runs with."""
        booted = self.booted
        return dataclasses.replace(
            self.config,
            served_model_name=self.config.served_model_name or Path(self.config.model).name,
            dtype=DTYPE_NAMES[booted.dtype],
            device=booted.device.type,
            context_length=self.context_length,
            kv_cache_dtype=booted.kv_cache_dtype,
            num_kv_pages=booted.num_pages,
        )

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        ids = self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; context_length is {self.context_length}")
        pool = self.booted.num_pages * self.config.page_size
        if len(ids) >= pool:
            raise ValueError(f"the prompt has {len(ids)} tokens; the KV pool holds {pool}")
        seq = Sequence(ids, params, self.tokenizer.detokenizer())
        seq.max_output = output_budget(len(ids), params.max_tokens, self.max_request_tokens)
        if request_id is not None:
            seq.request_id = request_id
        # The replica with the longest cached prefix of the prompt, then the fewest requests, then the most free pages.
        if len(self.schedulers) > 1:
            seq.replica = min(range(len(self.schedulers)), key=lambda r: self._replica_rank(self.schedulers[r], seq))
        self.sequences[seq.request_id] = seq
        self.schedulers[seq.replica].add(seq)
        return seq.request_id

    @staticmethod
    def _replica_rank(scheduler: Scheduler, seq: Sequence) -> tuple[int, int, int]:
        cached = scheduler.blocks.cached_tokens(scheduler.prompt_keys(seq))
        return -cached, len(scheduler.running) + len(scheduler.waiting), -scheduler.blocks.num_free

    def has_unfinished(self) -> bool:
        in_flight = self.in_flight.seqs if self.in_flight is not None else ()
        return any(s.has_work() for s in self.schedulers) or any(not seq.finished for seq in in_flight)

    def step(self) -> list[RequestOutput]:
        """Queue the next batch, then read the tokens of the one before it (and of this one when it samples on the
        host, or without overlap); an output for every request that got a token, or that failed.

        A request's failure is its own: one whose sampling or text fails ends with finish_reason "error" and the
        others go on. A step that fails as a whole fails the requests it held, not the engine, unless the device
        itself is broken (a CUDA error is sticky: synchronizing raises it again) or MAX_FAILED_STEPS steps in a
        row fail, which no request's input explains. Over several ranks a failed step ends the engine: the ranks
        would no longer agree on the steps they run."""
        work = [item for scheduler in self.schedulers for item in scheduler.schedule()]
        previous, self.in_flight = self.in_flight, None
        try:
            launched = self.runner.launch(work, previous) if work else None
        except Exception as error:
            if self.ranks is not None:
                self.broken = True
                raise
            self.runner.synchronize()
            self.failed_steps += 1
            if self.failed_steps >= MAX_FAILED_STEPS:
                raise
            outputs = self._read(previous) if previous is not None else []
            return outputs + [self._fail(item.seq, error) for item in work if not item.seq.finished]
        self.failed_steps = 0
        outputs = self._read(previous) if previous is not None else []
        if launched is not None:
            if launched.on_device and self.overlap:
                self.in_flight = launched
            else:
                outputs += self._read(launched)
        return outputs

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        outputs = []
        for seq, result in zip(step.seqs, step.results(), strict=True):
            seq.num_in_flight -= 1
            if seq.finished:  # it finished (or was aborted) before this step was read: the token is dropped
                continue
            try:
                if isinstance(result, Exception):
                    raise result
                outputs.append(self._append(seq, *result))
            except Exception as error:
                outputs.append(self._fail(seq, error))
        return outputs

    def _fail(self, seq: Sequence, error: Exception) -> RequestOutput:
        """End one request that failed inside the engine: its pages go back, its output says why."""
        log.exception("request_error", request_id=seq.request_id, error=repr(error), exc_info=error)
        self.sequences.pop(seq.request_id, None)
        self.schedulers[seq.replica].finish(seq, "error")
        output = self._output(seq, "error", "", ())
        output.error = f"{type(error).__name__}: {error}"
        return output

    def abort(self, request_id: str, reason: str = "abort") -> RequestOutput | None:
        """End a request now and free its pages; its final output (with `reason`), or None if it was not in flight."""
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.schedulers[seq.replica].finish(seq, reason)
        seq.text += seq.detokenizer.flush()
        sent, seq.num_text_sent = seq.num_text_sent, len(seq.text)
        return self._output(seq, reason, seq.text[sent:], ())

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        params = seq.params
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        before = len(seq.text)
        delta = seq.detokenizer.step(token)
        seq.text += delta
        reason = cut = None
        if (token == self.tokenizer.eos_id and not params.ignore_eos) or token in seq.stop_token_ids:
            reason = "stop"
        elif (cut := seq.stop_strings.feed(delta)) is not None:
            seq.text = seq.text[: before + cut]
            reason = "stop"
        elif len(seq.output_ids) >= seq.max_output:
            reason = "length"
        if reason is not None:
            if cut is None:
                seq.text += seq.detokenizer.flush()  # the last bytes of a cut character, if any
            self.schedulers[seq.replica].finish(seq, reason)
            del self.sequences[seq.request_id]
        # A delta never holds text that a stop string may still cut away, so streamed text equals the final text.
        sent = seq.num_text_sent
        seq.num_text_sent = max(sent, len(seq.text) - (0 if reason else seq.stop_strings.held_back))
        output = self._output(seq, reason, seq.text[sent : seq.num_text_sent], (token,))
        output.new_logprobs = (logprob,) if logprob is not None else ()
        return output

    @staticmethod
    def _output(seq: Sequence, reason: str | None, new_text: str, new_token_ids: tuple[int, ...]) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            text=seq.text,
            token_ids=seq.output_ids,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=reason,
            new_text=new_text,
            new_token_ids=new_token_ids,
            cached_tokens=seq.cached_tokens or 0,
        )
