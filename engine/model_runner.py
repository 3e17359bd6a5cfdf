"""Loads the model, sizes and allocates the KV pool, and runs one scheduled step: build the flattened batch,
forward, logits, sample. Boot stages `weights`, `kv_alloc` and `graph_capture` are logged as they happen.

KV pool sizing. On CUDA the pool gets what `gpu_memory_utilization` leaves after the weights, the CUDA-graph pool
and the peak workspace of the largest step the scheduler admits (`max_num_batched_tokens` tokens, whatever
`max_num_seqs` is), all measured with torch.cuda's memory counters, less `max_num_seqs` requests' fixed state
(window rings, compressor states). On CPU the pool holds `max_num_seqs` requests at full `context_length` unless
`num_kv_pages` says otherwise. Either way the model's paged cache is allocated over the pool at once, so capacity
and `kv_bytes` are counted from what was allocated.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from engine.cache.layout import KVLayout
from engine.cache.pool import PagePool
from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.model.state import ForwardBatch, SequenceState
from engine.sampler import sample
from engine.scheduler import ScheduledWork
from engine.sequence import TokenLogprob

log = structlog.get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but no CUDA device is visible")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


def layout_kv_dtype(config: EngineConfig, device: torch.device) -> str:
    """The row format the pool is sized and reported in: KVLayout knows the two serving formats, fp8 and bf16 (the
    CPU's float32 rows count as bf16 there)."""
    fp8 = config.kv_cache_dtype == "fp8_e4m3" or (config.kv_cache_dtype == "auto" and device.type == "cuda")
    return "fp8_e4m3" if fp8 else "bfloat16"


def under_wsl() -> bool:
    """WSL2's CUDA driver cannot pin much host memory, and pinned copies there fail or crawl."""
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


@dataclass(frozen=True)
class MemoryReport:
    """GPU memory as /server_info reports it, measured at boot; None where there is no GPU to measure."""

    total_bytes: int | None
    free_bytes: int | None  # after every allocation, when the engine became ready
    weights_bytes: int
    kv_bytes: int  # as allocated: the pool's pages plus every running slot's window ring and compressor state
    graph_bytes: int | None


class ModelRunner:
    def __init__(self, config: EngineConfig, context_length: int):
        self.config = config
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.pin_memory = self.device.type == "cuda" and not under_wsl()
        torch.manual_seed(config.seed)

        started = time.monotonic()
        self.model = load_model(config.model, self.dtype, self.device, config.quant_sim)  # logs load_progress
        if self.device.type == "cuda":
            weights_bytes = torch.cuda.memory_allocated(self.device)
        else:
            weights_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        log.info("boot_stage", stage="weights", seconds=_since(started), bytes=weights_bytes, device=str(self.device))

        started = time.monotonic()
        self.layout = KVLayout.for_model(self.model.args, config.page_size, layout_kv_dtype(config, self.device))
        if self.device.type == "cuda":
            num_pages = self._cuda_pool_pages(weights_bytes)
        else:
            num_pages = config.num_kv_pages or self.layout.pages_for(context_length) * config.max_num_seqs
        self.pool = PagePool(num_pages, config.page_size)
        # The cache over the pool's pages, with a window-ring slot for each running request.
        cache = self.model.allocate_kv_cache(self.pool, config.max_num_seqs, config.kv_cache_dtype)
        self.kv_cache_dtype = cache.kv_dtype
        cuda = self.device.type == "cuda"
        free, total = torch.cuda.mem_get_info(self.device) if cuda else (None, None)
        self.memory = MemoryReport(total, free, weights_bytes, cache.bytes, 0 if cuda else None)
        log.info(
            "boot_stage",
            stage="kv_alloc",
            seconds=_since(started),
            kv_pages=num_pages,
            kv_capacity_tokens=self.pool.capacity_tokens,
            kv_bytes=cache.bytes,
            kv_cache_dtype=self.kv_cache_dtype,
            pinned_host_memory=self.pin_memory,
        )
        # CUDA graphs come with the kernels' decode path; until then every step runs eagerly.
        log.info("boot_stage", stage="graph_capture", seconds=0.0, skipped="eager" if cuda else "cpu")

    def _cuda_pool_pages(self, weights_bytes: int) -> int:
        config = self.config
        workspace = self._peak_workspace_bytes()
        graph_bytes = 0
        free, total = torch.cuda.mem_get_info(self.device)
        budget = config.gpu_memory_utilization * total - (weights_bytes + graph_bytes + workspace)
        # Other processes may hold memory too: never plan past what is free now, less the workspace steps need.
        budget = min(budget, free - workspace)
        fixed = config.max_num_seqs * self.layout.per_sequence_state_bytes
        fit = int((budget - fixed) // self.layout.bytes_per_page)
        pages = config.num_kv_pages or fit
        if pages < 1 or pages > fit:
            raise RuntimeError(
                f"the KV pool does not fit: {pages} pages of {self.layout.bytes_per_page} B asked, room for {fit} "
                f"(gpu_memory_utilization {config.gpu_memory_utilization} of {total} B, weights {weights_bytes} B, "
                f"peak workspace {workspace} B for max_num_batched_tokens {config.max_num_batched_tokens}, "
                f"{fixed} B of per-request state for max_num_seqs {config.max_num_seqs}, {free} B free)"
            )
        return pages

    @torch.inference_mode()
    def _peak_workspace_bytes(self) -> int:
        """Peak memory of one step of the largest admitted shape, a `max_num_batched_tokens` prefill, over a
        cache just big enough for it (replaced by the real one right after)."""
        n, config = self.config.max_num_batched_tokens, self.config
        self.model.allocate_kv_cache(PagePool(self.layout.pages_for(n), config.page_size), 1, config.kv_cache_dtype)
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        state = self.model.new_state()
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        streams = self.model(ForwardBatch(ids, torch.arange(n, device=self.device), [state], [n]))
        self.model.logits(streams[-config.max_num_seqs :])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.model.release_state(state)
        del ids, streams
        torch.cuda.empty_cache()
        return peak

    def release(self, state: SequenceState) -> None:
        """A finished or preempted request gives its cache slot (and pages) back."""
        self.model.release_state(state)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values)
        if self.pin_memory:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @torch.inference_mode()
    def run(self, work: list[ScheduledWork]) -> list[tuple[int, TokenLogprob | None] | None]:
        """Advance each scheduled request by its tokens; a sampled token for those whose prompt is now complete."""
        ids, positions, states, lens = [], [], [], []
        for item in work:
            seq = item.seq
            if seq.state is None:
                seq.state = self.model.new_state(seq.page_table)
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + item.num_tokens])
            positions.extend(range(start, start + item.num_tokens))
            states.append(seq.state)
            lens.append(item.num_tokens)
        batch = ForwardBatch(self._to_device(ids), self._to_device(positions), states, lens)
        streams = self.model(batch)
        sampling = [item.completes_prompt for item in work]
        last_rows = [batch.starts[i] + lens[i] - 1 for i, s in enumerate(sampling) if s]
        logits = self.model.logits(streams[last_rows]).cpu() if last_rows else None
        results, row = [], 0
        for item, samples in zip(work, sampling, strict=True):
            item.seq.num_computed += item.num_tokens
            if samples:
                seq = item.seq
                remaining = seq.params.max_tokens - len(seq.output_ids)
                results.append(sample(logits[row], seq.params, seq.generator, remaining))
                row += 1
            else:
                results.append(None)
        return results


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
