"""`python -m engine.tools.train_demo --out DIR`: trains the demo model (issue 31) — a small DeepSeek-V4 with every
layer kind (window-only, c4 with the indexer, c128), hash- and score-routed MoE, mHC and one MTP layer — from the
engine's own modules, on engine/tools/demo_data.py's samples, and writes it as a checkpoint the engine serves.

How it trains, and why:

- The forward is the engine's prefill: samples are packed one after another into rows of at most row_tokens, each
  row one request of a batch (a slot and pages of a fresh fp32 cache per step, as the runner lays them out),
  `run_layers`, `logits`, `mtp_logits`. The references' work is launched per request and per layer, so a request per
  sample (most are a few hundred tokens) made the step launch-bound; a sample sees the ones before it in its row,
  as in packed pretraining, and each starts with BOS. A row holds retrieval samples of distinct code kinds only: an
  earlier haystack's needle of the question's kind would make it ambiguous (which code?), one of another kind is a
  distractor the lookup must pass over. (One retrieval sample a row made 25 rows of a 65K-token step, 17 now: the
  references' work per row is most of a step's launches.) A step is a number of tokens, not of rows.
  The plain-torch references are differentiable; the served Triton kernels have no backward, so it runs with
  FLASHGATE_KERNELS=autograd (set here: the references, and on a GPU the few kernels written with a backward, the
  Sinkhorn of mHC's ~120 launches an hc_pre among them) and with the FP8/FP4 activation simulation off (its rounding
  has no gradient).
- Loss: next-token cross-entropy on each sample's completion, plus the same on its prompt (`prompt_weight`: the
  prompts' repeats and echoes are what teaches the copying heads; the first run, on completions alone, recalled
  its training lists instead of copying and found no needle), plus the MTP
  layer's cross-entropy one token further (`mtp_weight`), plus the indexer's distillation: the lightning indexer gets
  no gradient through its top-k, so, as DeepSeek trains it (V3.2's dense warm-up), its scores over a query's visible
  c4 rows learn the main attention's distribution over the same rows (KL, the target detached; `indexer_weight`).
- Score-routed MoE layers balance their experts without an auxiliary loss, as V3/V4 do: after each step every
  expert's routing bias moves by `bias_update` towards the mean load (up when under-loaded).
- `--replicas N`: N processes train side by side (`Replicas`), each on a share of every step's rows, their gradients
  summed, for a device that one process's launches leave idle. A step is the same step whatever N (each loss a mean
  over the whole step's targets). On an H100 one process keeps the GPU 0.8 busy and 2 or 4 replicas under MPS train
  no faster (docs/demo-model.md).
- `--task-weights retrieval=4,...`: a task's completion tokens count that many times in the lm and MTP losses (a
  weighted mean): a task's share of the gradient apart from its share of the tokens.
- AdamW with warm-up and cosine decay, gradient clipping; seeded data, initial weights and batch order. The loss
  curve (`train_log.json`), the recipe and the checkpoint (bf16, ≤ 20 MB) go to --out; evaluation
  (`evaluate`) serves the written checkpoint through the engine and scores each held-out task with demo_data.score.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import math
import mmap
import multiprocessing
import multiprocessing.connection
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F

from engine.cache.kv_cache import ModelKVCache
from engine.llm import LLM
from engine.logging import configure_logging
from engine.model.args import ModelArgs
from engine.model.attention import Attention
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.loader import load_model
from engine.model.moe import Gate
from engine.model.random_init import randomize
from engine.model.state import ForwardBatch, SequenceState
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from engine.tools import demo_data
from engine.tools.make_tiny import TINY_CONFIG, save_hf_checkpoint
from engine.tools.tiny_tokenizer import save_tiny_tokenizer

log = structlog.get_logger(__name__)

PAGE_SIZE = 256
# The demo model: the tiny checkpoint's layer kinds, wider, fitting 20 MB (bf16, the fp32 tensors the reference
# keeps so), with V4's sliding window (128) and a top-k that matters at 4K tokens (1,024 c4 rows).
DEMO_CONFIG = TINY_CONFIG | {
    "hidden_size": 320,
    "sliding_window": 128,
    "index_topk": 64,
    "max_position_embeddings": 4096,
}
MAX_CHECKPOINT_BYTES = 20_000_000
LOSSES = ("lm", "prompt", "mtp", "indexer")
# The data seed of `evaluate`'s training-split samples: a run's calls draw theirs with its seed plus their first step
# (0 and up), so none trained on these.
TRAIN_SPLIT_SEED = -1
# How long a replica waits for the others at a step's sum before the run fails (a replica that died or hung).
REPLICA_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Recipe:
    """Everything a run depends on; written beside its results."""

    seed: int = 0
    train_samples: int = 60_000
    eval_per_task: int = 50
    max_tokens: int = demo_data.DEFAULT_MAX_TOKENS
    # The longest row a step packs samples into (`batches`): a row's work is mostly a fixed number of launches, so
    # rows longer than a sample make a step fewer of them, at the cost of attention and indexer work and memory
    # that grow with a row's length. Positions past the served context only shift RoPE's relative angles.
    row_tokens: int = demo_data.DEFAULT_MAX_TOKENS
    tokens_per_step: int = 65_536
    steps: int = 2_000
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 30
    # Steps whose c4 layers attend every visible row (Attention.dense_warmup) while the indexer learns the main
    # attention's distribution; the rest attend the indexer's top-k, as served. 200: about the share run 6 took (180
    # of 900 steps) of a session's run.
    dense_warmup_steps: int = 200
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    prompt_weight: float = 0.3
    mtp_weight: float = 0.3
    indexer_weight: float = 1.0
    bias_update: float = 1e-3
    # A task's completion tokens count this many times in the lm and MTP losses (a task not named: once).
    task_weights: dict = field(default_factory=dict)
    # A checkpoint to start from (an earlier run's --out) instead of the seeded random weights, and the step of the
    # schedule it goes on from: a run longer than one device call goes on from the last one's weights, its optimizer
    # state started afresh (warmed up again) and its samples drawn anew (seed + first_step), not repeated.
    init: str = ""
    first_step: int = 0
    config: dict = field(default_factory=lambda: dict(DEMO_CONFIG))

    def __post_init__(self) -> None:
        unknown = set(self.task_weights) - set(demo_data.TASKS)
        if unknown or any(w <= 0 for w in self.task_weights.values()):
            raise ValueError(f"task_weights: positive weights of {demo_data.TASKS}, not {self.task_weights}")
        if self.row_tokens < self.max_tokens:
            raise ValueError(f"row_tokens ({self.row_tokens}) must hold the longest sample, max_tokens "
                             f"({self.max_tokens})")  # fmt: skip

    def lr_at(self, step: int) -> float:
        """Linear warm-up from the run's first step, then the schedule's cosine decay over all its steps."""
        ramp = min(1.0, (step - self.first_step + 1) / self.warmup_steps)
        done = max(0, step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, done)))
        return ramp * self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)

    @property
    def data_seed(self) -> int:
        return self.seed + self.first_step


@dataclass(frozen=True)
class Example:
    """A sample's tokens: prompt then completion; the loss covers the completion. `needle`: a retrieval sample's code
    kind, which its question names (a row holds at most one needle of a kind)."""

    ids: torch.Tensor
    prompt_len: int
    needle: str | None = None
    weight: float = 1.0  # of its completion's tokens in the lm and MTP losses (Recipe.task_weights)


# Samples packed one after another into one sequence (one request of the prefill batch).
Row = tuple[Example, ...]


def initial_model(recipe: Recipe, device: torch.device) -> DeepseekV4:
    """The starting point: `recipe.init`'s weights (a run resumed, in fp32), or the seeded random one: randomize's
    unit-variance matrices, with the tensors it randomises for parity tests set to what training starts from (sinks,
    position and routing biases zero, norms one). Every float tensor is trainable except the routing biases (moved
    by the balance rule)."""
    if recipe.init:
        model = load_model(recipe.init, torch.float32, device, quant_sim=False).train()
    else:
        model = randomize(DeepseekV4(ModelArgs.from_config(recipe.config), quant_sim=False), recipe.seed).to(device)
    with torch.no_grad():
        for name, param in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if (
                not recipe.init
                and leaf in ("attn_sink", "ape", "bias")
                or (leaf.startswith("hc_") and leaf.endswith("_base"))
            ):
                param.zero_()
            elif not recipe.init and (
                name.endswith("norm.weight") or (leaf.startswith("hc_") and leaf.endswith("_scale"))
            ):
                param.fill_(1.0)
            param.requires_grad_(param.is_floating_point() and not name.endswith("gate.bias"))
    return model


def examples(samples: Sequence[demo_data.Sample], task_weights: dict[str, float] | None = None) -> list[Example]:
    weights = task_weights or {}
    return [Example(torch.tensor(s.token_ids), s.prompt_tokens, s.check["kind"] if s.task == "retrieval" else None,
                    weights.get(s.task, 1.0)) for s in samples]  # fmt: skip


def batches(items: Sequence[Example], tokens_per_step: int, row_tokens: int, seed: int) -> Iterator[list[Row]]:
    """Endless steps of at most tokens_per_step tokens (a longer sample is a step of its own): an epoch's order drawn
    from the seed, each sample in turn put into the first of the step's rows with room for it (a row holds at most
    row_tokens, and at most one `needle` of a kind), else into a new row."""
    rng = random.Random(f"{seed}/batches")
    while True:
        order = list(items)
        rng.shuffle(order)
        rows: list[list[Example]] = []
        held: list[int] = []
        for item in order:
            n = len(item.ids)
            if rows and sum(held) + n > tokens_per_step:
                yield [tuple(row) for row in rows]
                rows, held = [], []
            fits = (r for r, h in enumerate(held) if h + n <= row_tokens and not _same_needle(item, rows[r]))
            room = next(fits, None)
            if room is None:
                rows.append([])
                held.append(0)
                room = len(rows) - 1
            rows[room].append(item)
            held[room] += n
        if rows:
            yield [tuple(row) for row in rows]


def _same_needle(item: Example, row: list[Example]) -> bool:
    return item.needle is not None and any(e.needle == item.needle for e in row)


def forward_batch(model: DeepseekV4, rows: Sequence[Row], device: torch.device) -> ForwardBatch:
    """The rows as a prefill batch of one request each, over a fresh fp32 cache bound to the model."""
    lens = [sum(len(e.ids) for e in row) for row in rows]
    pages = [-(-n // PAGE_SIZE) for n in lens]
    cache = ModelKVCache(model.args, sum(pages), PAGE_SIZE, len(rows), "float32", device)
    model.bind_kv_cache(cache)
    table = torch.zeros(len(rows), max(pages), dtype=torch.int32)
    first = 0
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    ids = torch.cat([e.ids for row in rows for e in row]).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    batch = ForwardBatch(ids, positions, [SequenceState(slot=i) for i in range(len(rows))], lens)
    batch.set_tables(table.to(device), torch.arange(len(rows), dtype=torch.int32, device=device))
    return batch


@contextmanager
def indexer_distillation(losses: list[torch.Tensor]) -> Iterator[None]:
    """While active, every c4 layer's prefill adds its indexer's KL to the main attention to `losses`."""
    original = Attention._prefill_reference

    def prefill(self, q, proj, positions, p0, span, comp_slots, index_slots):
        if self.indexer is not None:
            losses.append(indexer_kl(self, q, proj["query"], positions, comp_slots, index_slots))
        return original(self, q, proj, positions, p0, span, comp_slots, index_slots)

    Attention._prefill_reference = prefill
    try:
        yield
    finally:
        Attention._prefill_reference = original


def indexer_kl(attn: Attention, q, index_query, positions, comp_slots, index_slots) -> torch.Tensor:
    """KL(main attention's mean distribution over a query's visible c4 rows || the indexer's softmax over them),
    averaged over the queries that see a row; the target is detached. Nothing in it waits for the device (a row's
    first queries see none: their KL is zero and left out of the mean by count, not by a mask's selection)."""
    iq, iw = index_query
    visible = (positions + 1) // attn.ratio
    allowed = torch.arange(len(comp_slots), device=q.device)[None, :] < visible[:, None]
    keys = attn.kv.index.read(index_slots).to(iq.dtype)
    rows = attn.kv.comp.read(comp_slots).to(q.dtype)
    scores = torch.einsum("thd,nd->thn", iq, keys).relu().mul(iw[..., None]).sum(dim=1)
    log_q = torch.log_softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    with torch.no_grad():
        target = c4_attention(attn, q, rows, allowed).mean(dim=1)
    # (a query that sees no row has NaN in log_q, whose gradient masked_fill stops)
    kl = torch.where(allowed, target * (torch.log(target.clamp_min(1e-20)) - log_q), 0.0).sum(dim=-1)
    return kl.sum() / (visible > 0).sum().clamp(min=1)


def c4_attention(attn: Attention, q: torch.Tensor, rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The main attention's distribution over each query's visible c4 rows alone, per head: [T, heads, rows]."""
    logits = torch.einsum("thd,nd->thn", q, rows) * attn.scale
    return torch.softmax(logits.masked_fill(~allowed[:, None, :], float("-inf")), dim=-1)


def balanced_gates(model: DeepseekV4) -> list[Gate]:
    """The score-routed gates: those with a routing bias, which the balance rule moves."""
    return [m for m in model.modules() if isinstance(m, Gate) and m.bias is not None]


@contextmanager
def routing_loads(model: DeepseekV4) -> Iterator[dict[Gate, torch.Tensor]]:
    """Each score-routed gate's expert loads (tokens routed to each expert) over the forwards run while active."""
    loads: dict[Gate, torch.Tensor] = {}

    def record(gate: Gate, args, output) -> None:
        ids = output[1].detach().flatten()
        # Not bincount, which on CUDA waits for the device to read the ids' maximum.
        load = torch.zeros(gate.weight.shape[0], device=ids.device).scatter_add_(
            0, ids, torch.ones_like(ids, dtype=torch.float32)
        )
        loads[gate] = loads.get(gate, 0) + load

    hooks = [gate.register_forward_hook(record) for gate in balanced_gates(model)]
    try:
        yield loads
    finally:
        for hook in hooks:
            hook.remove()


@torch.no_grad()
def balance_routing(loads: dict[Gate, torch.Tensor], rate: float) -> None:
    """Aux-loss-free balancing: each expert's routing bias moves by `rate` towards the mean load (up when
    under-loaded)."""
    for gate, load in loads.items():
        gate.bias.add_(rate * torch.sign(load.mean() - load))


def losses(model: DeepseekV4, rows: Sequence[Row], device: torch.device,
           step_rows: Sequence[Row] | None = None) -> dict[str, torch.Tensor]:  # fmt: skip
    """The step's four losses on `rows` (see the module's docstring), each a mean over its targets in `step_rows`
    (`rows` by default): the losses of replicas' shares of a step (`Replicas`) add up to the step's."""
    counts = target_counts(step_rows if step_rows is not None else rows, indexed_layers(model))
    batch = forward_batch(model, rows, device)
    items = [e for row in rows for e in row]
    kls: list[torch.Tensor] = []
    # Row t predicts token t+1 (main head) and t+2 (MTP) of its own sample, inside the completion. Copied before the
    # forward is queued: a copy from the host waits for the device's queue to empty.
    next_ids = torch.cat([torch.cat([e.ids[1:], e.ids[-1:]]) for e in items]).to(device)
    lm_target = torch.tensor([t for e in items for t in _target(e, 1)], device=device)
    mtp_target = torch.tensor([t for e in items for t in _target(e, 2)], device=device)
    weight = torch.tensor([e.weight for e in items for _ in range(len(e.ids))], device=device)
    prompt_target = torch.tensor([t for e in items for t in _prompt_target(e)], device=device)
    with indexer_distillation(kls):
        streams = model.run_layers(batch)
        logits = model.logits(streams)
        lm = (F.cross_entropy(logits, lm_target, ignore_index=-100, reduction="none") * weight).sum()
        prompt = F.cross_entropy(logits, prompt_target, ignore_index=-100, reduction="sum")
        mtp = (F.cross_entropy(model.mtp_logits(streams, next_ids, batch), mtp_target, ignore_index=-100,
                               reduction="none") * weight).sum()  # fmt: skip
    indexer = torch.stack(kls).sum() if kls else streams.new_zeros(())
    sums = dict(zip(LOSSES, (lm, prompt, mtp, indexer), strict=True))
    return {name: total / max(1, counts[name]) for name, total in sums.items()}


def indexed_layers(model: DeepseekV4) -> int:
    """The layers with a lightning indexer (c4): each adds one distillation loss a row."""
    return sum(1 for m in model.modules() if isinstance(m, Attention) and m.indexer is not None)


def target_counts(rows: Sequence[Row], indexed: int) -> dict[str, float]:
    """How many targets each loss has in `rows` (the -100s of `_target` and `_prompt_target` left out; the lm and MTP
    ones counted at their examples' weights), and the indexer's distillation losses: one a row and indexed layer."""
    items = [e for row in rows for e in row]
    return {"lm": sum(e.weight * _completion_span(e, 1)[1] for e in items),
            "mtp": sum(e.weight * _completion_span(e, 2)[1] for e in items),
            "prompt": sum(max(0, min(e.prompt_len, len(e.ids)) - 1) for e in items),
            "indexer": indexed * len(rows)}  # fmt: skip


def _prompt_target(e: Example) -> list[int]:
    """Token t+1 for row t where that token is in the prompt, else ignored (-100)."""
    ids = e.ids.tolist()
    inside = ids[1 : e.prompt_len]
    return inside + [-100] * (len(ids) - len(inside))


def _target(e: Example, ahead: int) -> list[int]:
    """Token t+ahead for row t where it is a completion token, else ignored (-100). Lists, not tensor ops: a step
    has a few hundred samples."""
    ids = e.ids.tolist()
    start, n = _completion_span(e, ahead)
    return [-100] * start + ids[start + ahead :] + [-100] * (len(ids) - start - n)


def _completion_span(e: Example, ahead: int) -> tuple[int, int]:
    """The first row whose token `ahead` on is in the completion, and how many rows have such a target."""
    start = min(len(e.ids), max(0, e.prompt_len - ahead))
    return start, max(0, len(e.ids) - start - ahead)


class Replicas:
    """Data parallelism within one host: `count` processes forked from the trainer, each with the same model on its
    device (a host's GPUs in turn: all on one GPU when it has one) and a share of every step's rows. The demo model's
    step is a long series of small kernels that the host launches one after another, leaving the GPU mostly idle;
    replicas launch theirs side by side. A step's gradients, losses and routing loads are summed through shared
    memory, each element by one replica for all, in replica order: the sums are bit-identical everywhere, so the
    replicas' optimizer steps keep them identical. The trainer itself touches no GPU (a forked process cannot use its
    parent's CUDA), so it can run one training after another. A replica that fails stops the others at their next
    sum, and the trainer raises with its error. `Replicas()` is the one process, the trainer's own."""

    def __init__(self, count: int = 1, floats: int = 0, timeout_s: float = REPLICA_TIMEOUT_S):
        if count < 1:
            raise ValueError(f"replicas must be at least 1, not {count}")
        self.count, self.index, self.timeout_s = count, 0, timeout_s
        if count > 1:
            self._context = multiprocessing.get_context("fork")
            # Anonymous shared memory, inherited by the forked replicas (not /dev/shm, which containers keep small):
            # each replica's figures to add, then their sum.
            self._memory = mmap.mmap(-1, (count + 1) * max(1, floats) * 4)
            shared = torch.frombuffer(self._memory, dtype=torch.float32).view(count + 1, max(1, floats))
            self._slots, self._total = shared[:count], shared[count]
            self._barrier = self._context.Barrier(count, timeout=timeout_s)
            self._errors = self._context.SimpleQueue()

    def run(self, replica: Callable[[], None]) -> None:
        """`replica()` in every replica: here when there is one, else in `count` forked processes, waited for."""
        if self.count == 1:
            replica()
            return
        processes = [self._context.Process(target=self._forked, args=(i, replica), daemon=True)
                     for i in range(self.count)]  # fmt: skip
        for process in processes:
            process.start()
        try:
            self._wait(processes)
        finally:
            for process in processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        if not self._errors.empty():
            index, error = self._errors.get()
            raise RuntimeError(f"replica {index} of {self.count} failed: {error}")
        failed = {i: process.exitcode for i, process in enumerate(processes) if process.exitcode}
        if failed:
            raise RuntimeError(f"replicas ended without finishing (replica: exit code): {failed}; one that hung has "
                               f"printed its stack to stderr after {self.timeout_s:g} s")  # fmt: skip

    def _wait(self, processes: list[multiprocessing.Process]) -> None:
        """Until every replica has ended, or, once one has failed, the others have had the timeout to end."""
        deadline = None
        while any(process.is_alive() for process in processes):
            if deadline is None and any(process.exitcode for process in processes):
                deadline = time.monotonic() + self.timeout_s
            if deadline is not None and time.monotonic() > deadline:
                return
            multiprocessing.connection.wait([p.sentinel for p in processes if p.is_alive()], timeout=1.0)

    def _forked(self, index: int, replica: Callable[[], None]) -> None:
        self.index = index
        # One CPU thread: GNU OpenMP's pool is not fork-safe, and a replica's first parallel region after the
        # trainer used its own hung (on a 16-core host, both replicas in `sum`'s copy into the shared slots). A
        # replica's CPU work is that copy and sum; its model runs on the GPU (on the CPU, one process with every
        # thread is the faster run).
        torch.set_num_threads(1)
        # A replica that has not reached its next sum after the timeout prints every thread's stack to stderr (where
        # it hangs or, waiting at the sum, that another does) and exits, so that the run ends even when every replica
        # hangs. `sum` winds the timer again.
        faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        try:
            replica()
        except threading.BrokenBarrierError:  # another replica failed (its error is the one reported) or hung
            sys.exit(1)
        except BaseException as error:
            self._errors.put((index, f"{type(error).__name__}: {error}"))
            self._barrier.abort()
            raise
        finally:
            faulthandler.cancel_dump_traceback_later()

    def device(self, device: torch.device) -> torch.device:
        """This replica's device: a host's GPUs taken in turn."""
        if device.type != "cuda" or device.index is not None or torch.cuda.device_count() < 2:
            return device
        return torch.device("cuda", self.index % torch.cuda.device_count())

    def share(self, rows: Sequence[Row]) -> list[Row]:
        """This replica's rows of a step: dealt longest first, so that shares hold as many rows and about as many
        tokens (a row's work is mostly its launches, then its tokens)."""
        if self.count == 1:
            return list(rows)
        longest_first = sorted(range(len(rows)), key=lambda i: -sum(len(e.ids) for e in rows[i]))
        return [rows[i] for i in sorted(longest_first[self.index :: self.count])]

    def sum(self, tensors: Sequence[torch.Tensor]) -> None:
        """Each of `tensors` (fp32, on any device) replaced by its sum over the replicas, in place."""
        if self.count == 1:
            return
        faulthandler.dump_traceback_later(self.timeout_s, exit=True)
        # A GPU copies only to and from this process's own memory; the CPU alone touches the shared mapping.
        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).float().cpu()
        n = len(flat)
        # Two waits: the slots are read only between them, and the sum is written in the next call only after its
        # first wait, which every replica reaches having read this one.
        self._slots[self.index, :n].copy_(flat)
        self._barrier.wait()
        lo, hi = n * self.index // self.count, n * (self.index + 1) // self.count
        torch.sum(self._slots[:, lo:hi], dim=0, out=self._total[lo:hi])
        self._barrier.wait()
        summed = self._total[:n].clone().to(tensors[0].device)
        for t, part in zip(tensors, summed.split([t.numel() for t in tensors]), strict=True):
            t.copy_(part.view_as(t))

    def any(self, flag: bool) -> bool:
        """Whether any replica says so: a decision (stop now) they all take at the same step."""
        box = torch.tensor([float(flag)])
        self.sum([box])
        return bool(box.item())


def train(recipe: Recipe, out: Path, device: torch.device | None = None, held_out: Path = demo_data.QUALIFICATION_MD,
          stop_after_s: float = 0.0, replicas: int = 1,
          replica_timeout_s: float = REPLICA_TIMEOUT_S) -> None:  # fmt: skip
    """Train as the recipe says, on samples that share no 8-token run with the gates' texts in `held_out`
    (qualification.md), in `replicas` processes (`Replicas`, waiting `replica_timeout_s` for one another at a step's
    sum) on `device` (None: a GPU if there is one); the loss curve and the checkpoint go to `out`. With
    `stop_after_s`, the run ends after the first step past that many seconds of training, its checkpoint written:
    the next call goes on from it."""
    with differentiable_kernels():
        _train(recipe, out, device, held_out, stop_after_s, replicas, replica_timeout_s)


@contextmanager
def differentiable_kernels() -> Iterator[None]:
    """While active, the differentiable implementations: the plain-torch references, and on a GPU the Triton kernels
    written with a backward."""
    before = os.environ.get("FLASHGATE_KERNELS")
    os.environ["FLASHGATE_KERNELS"] = "autograd"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FLASHGATE_KERNELS"]
        else:
            os.environ["FLASHGATE_KERNELS"] = before


def _train(recipe: Recipe, out: Path, device: torch.device | None, held_out: Path, stop_after_s: float,
           count: int, timeout_s: float) -> None:  # fmt: skip
    torch.manual_seed(recipe.data_seed)
    # TF32 products in the fp32 training: the model's own bf16 checkpoint is coarser than their rounding.
    torch.backends.cuda.matmul.allow_tf32 = True
    tokenizer = demo_data.default_tokenizer()
    config = demo_data.Config(seed=recipe.data_seed, max_tokens=recipe.max_tokens)
    samples = demo_data.generate("train", demo_data.mix_counts(recipe.train_samples), config, tokenizer)
    samples = demo_data.without_held_out(samples, demo_data.held_out_texts(held_out), tokenizer)
    train_items = examples(samples, recipe.task_weights)
    # Made on the CPU, before any replica is forked: every replica starts from these same weights.
    model = initial_model(recipe, torch.device("cpu"))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    gates = sum(gate.weight.shape[0] for gate in balanced_gates(model))
    replicas = Replicas(count, floats=trainable + len(LOSSES) + gates, timeout_s=timeout_s)

    def replica() -> None:
        here = replicas.device(device or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        model.to(here)
        optimizer = optimizer_for(model, recipe)
        curve = earlier_curve(recipe)
        started, tokens, spent = time.perf_counter(), 0, curve[-1]["tokens"] if curve else 0
        steps = batches(train_items, recipe.tokens_per_step, recipe.row_tokens, recipe.data_seed)  # endless
        for step, rows in zip(range(recipe.first_step, recipe.steps), steps, strict=False):
            try:
                measured = train_step(model, optimizer, rows, recipe, step, here, replicas)
            except FloatingPointError:  # stop with the curve so far rather than train on NaN
                if replicas.index == 0:
                    _write_log(out, recipe, curve, here, count)
                raise
            tokens += sum(len(e.ids) for row in rows for e in row)
            record = {"step": step, "lr": recipe.lr_at(step), **{k: round(v, 4) for k, v in measured.items()},
                      "tokens": spent + tokens, "tok_s": round(tokens / (time.perf_counter() - started))}  # fmt: skip
            curve.append(record)
            if replicas.index == 0 and (step % 10 == 0 or step == recipe.steps - 1):
                log.info("train_step", **record)
            if replicas.any(bool(stop_after_s) and time.perf_counter() - started > stop_after_s):
                if replicas.index == 0:
                    log.info("train_stopped", step=step, after_s=round(time.perf_counter() - started),
                             steps=recipe.steps)  # fmt: skip
                break
        if replicas.index == 0:
            dense_warmup(model, False)
            _write_log(out, recipe, curve, here, count)
            save(model, recipe, out)

    replicas.run(replica)


def optimizer_for(model: DeepseekV4, recipe: Recipe) -> torch.optim.AdamW:
    """AdamW over the trainable tensors, weight decay on the matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    plain = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": plain, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=(0.9, 0.95))


def dense_warmup(model: DeepseekV4, on: bool) -> None:
    for attn in model.modules():
        if isinstance(attn, Attention) and attn.indexer is not None:
            attn.dense_warmup = on


def train_step(model: DeepseekV4, optimizer: torch.optim.Optimizer, rows: Sequence[Row], recipe: Recipe, step: int,
               device: torch.device, replicas: Replicas | None = None) -> dict[str, float]:  # fmt: skip
    """Step `step` of the schedule on `rows`: its lr, dense or sparse c4 attention, the weighted losses' gradient
    clipped, the optimizer's step, the routing biases balanced. With `replicas`, this process computes its share of
    the rows and the step goes on from the sum of every replica's gradients, losses and routing loads. Returns the
    losses and the gradient norm; raises FloatingPointError (before updating anything) when the norm is not
    finite."""
    replicas = replicas or Replicas()
    for group in optimizer.param_groups:
        group["lr"] = recipe.lr_at(step)
    dense_warmup(model, step < recipe.dense_warmup_steps)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    gates = balanced_gates(model)
    optimizer.zero_grad(set_to_none=True)
    mine = replicas.share(rows)
    with routing_loads(model) as loads:
        parts = losses(model, mine, device, rows) if mine else dict.fromkeys(LOSSES, torch.zeros((), device=device))
    if mine:
        total = (parts["lm"] + recipe.prompt_weight * parts["prompt"] + recipe.mtp_weight * parts["mtp"]
                 + recipe.indexer_weight * parts["indexer"])  # fmt: skip
        total.backward()
    for p in params:  # a replica with no rows, or a tensor its rows did not reach, adds zeros
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    figures = torch.stack([parts[name].detach() for name in LOSSES])
    step_loads = [loads.get(gate, torch.zeros(gate.weight.shape[0], device=device)) for gate in gates]
    replicas.sum([*grads, figures, *step_loads])
    grad_norm = torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
    # One read back from the device a step, not one per figure.
    measured = dict(zip(["grad_norm", *LOSSES], torch.cat([grad_norm[None], figures]).tolist(), strict=True))
    if not math.isfinite(measured["grad_norm"]):
        raise FloatingPointError(f"step {step}: the gradient norm is {measured['grad_norm']} (losses {measured})")
    optimizer.step()
    balance_routing(dict(zip(gates, step_loads, strict=True)), recipe.bias_update)
    return measured


def _earlier_log(recipe: Recipe) -> dict:
    earlier = Path(recipe.init) / "train_log.json" if recipe.init else None
    return json.loads(earlier.read_text()) if earlier is not None and earlier.is_file() else {}


def earlier_curve(recipe: Recipe) -> list[dict]:
    """A resumed run's curve begins with the steps before its first one, from the checkpoint's own train_log.json
    (their `tokens` count on): the run that spans calls is recorded whole."""
    return [c for c in _earlier_log(recipe).get("curve", []) if c["step"] < recipe.first_step]


def _write_log(out: Path, recipe: Recipe, curve: list[dict], device: torch.device, replicas: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Each call's recipe and the steps it took, the resumed checkpoint's calls first: what reproduces a run that
    # spans calls, whose ends are set by time (--stop-after-s) and whose schedules may differ.
    calls = [c for c in _earlier_log(recipe).get("calls", []) if c["last_step"] < recipe.first_step]
    took = [c["step"] for c in curve if c["step"] >= recipe.first_step]
    if took:
        own = {k: v for k, v in dataclasses.asdict(recipe).items() if k != "config"}  # the run's, at the top
        calls.append({"recipe": own, "replicas": replicas, "first_step": took[0], "last_step": took[-1]})
    where = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
        "replicas": replicas,
        # the first replica's (they are alike), allocator's count
        "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        "commit": os.environ.get("FLASHGATE_COMMIT", "unknown"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
    }
    log = {"recipe": dataclasses.asdict(recipe), **where, "calls": calls, "curve": curve}
    (out / "train_log.json").write_text(json.dumps(log) + "\n")


def save(model: DeepseekV4, recipe: Recipe, out: Path) -> None:
    """The checkpoint in the Hugging Face layout, bf16, with the tokenizer it was trained with (demo_data's)."""
    for param in model.parameters():
        param.requires_grad_(False)
    save_hf_checkpoint(model.cpu().cast(torch.bfloat16), out, recipe.config)
    save_tiny_tokenizer(out, recipe.config["vocab_size"], split_digits=True)
    size = (out / "model.safetensors").stat().st_size
    if size > MAX_CHECKPOINT_BYTES:
        raise ValueError(f"the checkpoint is {size} bytes, over the {MAX_CHECKPOINT_BYTES} the project ships")


def evaluate(model_dir: Path, recipe: Recipe, device: str = "auto", split: str = "eval",
             per_task: int = 0) -> dict[str, float]:  # fmt: skip
    """Greedy answers of the written checkpoint, served by the engine, to `per_task` samples a task (default: the
    recipe's eval_per_task) of `split`: accuracy per task. "eval" is the held-out split; "train" draws fresh samples of
    the training distribution (TRAIN_SPLIT_SEED: none the run trained on), which tells a task the model has not
    learned from one it has learned but does not carry to held-out phrasings and names. Each answer, with its
    sample's template, the completion it should be and the verdict, is kept in `{split}_answers.jsonl` beside the
    checkpoint: the evidence a failing task is diagnosed from."""
    tokenizer = Tokenizer.from_model_dir(model_dir)
    seed = recipe.seed if split == "eval" else TRAIN_SPLIT_SEED
    config = demo_data.Config(seed=seed, max_tokens=recipe.max_tokens)
    counts = dict.fromkeys(demo_data.TASKS, per_task or recipe.eval_per_task)
    samples = demo_data.generate(split, counts, config, tokenizer)
    # Room for an answer's overrun past the reference's length, within the positions the model has.
    context = min(recipe.max_tokens + 256, recipe.config["max_position_embeddings"])
    with LLM(model_dir, device=device, context_length=context) as llm:
        prompts = [s.token_ids[: s.prompt_tokens] for s in samples]
        params = [SamplingParams(temperature=0, max_tokens=s.completion_tokens + 32) for s in samples]
        outputs = llm.generate(prompts, params)
    correct: dict[str, list[bool]] = {}
    with (model_dir / f"{split}_answers.jsonl").open("w", encoding="utf-8") as answers:
        for sample, output in zip(samples, outputs, strict=True):
            text = tokenizer.decode(output.token_ids, skip_special_tokens=False)
            ok = demo_data.score(sample.task, sample, text)
            correct.setdefault(sample.task, []).append(ok)
            record = {"id": sample.id, "task": sample.task, "template": sample.template, "ok": ok,
                      "expected": sample.completion, "answer": text}  # fmt: skip
            if sample.task == "retrieval":
                record["needle_distance"] = demo_data.needle_distance(sample, tokenizer)
            answers.write(json.dumps(record) + "\n")
    return {task: round(sum(ok) / len(ok), 4) for task, ok in correct.items()}


def _task_weights(text: str) -> dict[str, float]:
    try:
        weights = {task.strip(): float(w) for task, w in (pair.split("=") for pair in text.split(",") if pair)}
        Recipe(task_weights=weights)  # its check of the tasks and weights
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"TASK=WEIGHT pairs joined by commas ({error})") from None
    return weights


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the checkpoint and train_log.json")
    # Not torch.cuda.is_available() here: CUDA touched before the replicas are forked is unusable in them.
    parser.add_argument("--device", default=None, help="cuda or cpu (default: a GPU if there is one)")
    parser.add_argument("--replicas", type=int, default=1, help="processes training side by side (Replicas)")
    parser.add_argument("--replica-timeout-s", type=float, default=REPLICA_TIMEOUT_S,
                        help="how long a replica waits for the others at a step's sum; one that has not come by then "
                        "prints its stack")  # fmt: skip
    parser.add_argument("--held-out", type=Path, default=demo_data.QUALIFICATION_MD, help="the gates' qualification.md")
    parser.add_argument("--stop-after-s", type=float, default=0.0, help="end after this many seconds of training")
    parser.add_argument("--no-eval", action="store_true", help="write the checkpoint without evaluating it")
    for f in dataclasses.fields(Recipe):
        if f.name not in ("config", "task_weights"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    parser.add_argument("--task-weights", type=_task_weights, default={}, metavar="TASK=W,...",
                        help="a task's completion tokens count W times in the lm and MTP losses")  # fmt: skip
    args = parser.parse_args(argv)
    configure_logging()
    recipe = Recipe(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Recipe) if f.name != "config"})
    train(recipe, args.out, args.device and torch.device(args.device), args.held_out, args.stop_after_s,
          args.replicas, args.replica_timeout_s)  # fmt: skip
    if args.no_eval:
        return
    accuracy = evaluate(args.out, recipe, args.device or "auto")
    (args.out / "eval.json").write_text(json.dumps({"recipe": dataclasses.asdict(recipe), "accuracy": accuracy}) + "\n")
    log.info("evaluated", **accuracy)


if __name__ == "__main__":
    main()
