"""The engine core: requests in, one `step()` at a time (schedule, run, sample), outputs out. The offline `LLM`
and the HTTP server are both thin loops over it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.model.args import ModelArgs
from engine.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence, TokenLogprob
from engine.tokenizer import Tokenizer


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    new_text: str = ""  # what this step added to `text`
    new_token_ids: tuple[int, ...] = ()

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None):
        self.config = config
        self.model_args = ModelArgs.from_model_dir(config.model)
        self.context_length = config.context_length or self.model_args.max_position_embeddings
        if self.context_length > self.model_args.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_length} exceeds the model's maximum "
                f"{self.model_args.max_position_embeddings}"
            )
        self.tokenizer = Tokenizer.from_model_dir(config.model)
        self.runner = ModelRunner(config, progress)
        self.scheduler = Scheduler(config)
        self.sequences: dict[str, Sequence] = {}

    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        ids = self.tokenizer.encode(prompt, add_bos=True) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise ValueError(f"the prompt has {len(ids)} tokens; context_length is {self.context_length}")
        seq = Sequence(ids, params, self.tokenizer.detokenizer())
        if request_id is not None:
            seq.request_id = request_id
        self.sequences[seq.request_id] = seq
        self.scheduler.add(seq)
        return seq.request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns an output for every request that produced a token this step."""
        work = self.scheduler.schedule()
        if not work:
            return []
        outputs = []
        for item, result in zip(work, self.runner.run(work), strict=True):
            if result is not None:
                outputs.append(self._append(item.seq, *result))
        return outputs

    def abort(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None and not seq.finished:
            if seq in self.scheduler.waiting:
                self.scheduler.waiting.remove(seq)
            self.scheduler.finish(seq, "abort")

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> RequestOutput:
        params = seq.params
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        before = len(seq.text)
        seq.text += seq.detokenizer.step(token)
        reason = None
        if (token == self.tokenizer.eos_id and not params.ignore_eos) or token in params.stop_token_ids:
            reason = "stop"
        elif stop := next((s for s in params.stop if s in seq.text[max(0, before - len(s) + 1) :]), None):
            seq.text = seq.text[: seq.text.index(stop, max(0, before - len(stop) + 1))]
            reason = "stop"
        elif len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.context_length:
            reason = "length"
        if reason is not None:
            if not params.stop or not any(s in seq.text for s in params.stop):
                seq.text += seq.detokenizer.flush()  # the last bytes of a cut character, if any
            self.scheduler.finish(seq, reason)
            del self.sequences[seq.request_id]
        return RequestOutput(
            request_id=seq.request_id,
            prompt_token_ids=seq.prompt_ids,
            text=seq.text,
            token_ids=list(seq.output_ids),
            logprobs=list(seq.logprobs) if params.logprobs is not None else None,
            finish_reason=reason,
            new_text=seq.text[before:],
            new_token_ids=(token,),
        )
