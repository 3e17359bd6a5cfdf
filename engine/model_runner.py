"""Loads the model, sizes and allocates the KV pool, and queues one scheduled step on the device (`launch`): build
the flattened batch, forward, logits, sample, without waiting for the device (see llm_engine.py). Boot stages
`weights`, `kv_alloc` and `graph_capture` are logged as they happen.

KV pool sizing. On CUDA the pool gets what `gpu_memory_utilization` leaves after the weights, the CUDA-graph pool
and the peak workspace of the largest step the scheduler admits (`max_num_batched_tokens` tokens, whatever
`max_num_seqs` is), all measured with torch.cuda's memory counters, less `max_num_seqs` requests' fixed state
(window rings, compressor states). On CPU the pool holds `max_num_seqs` requests at full `context_length` unless
`num_kv_pages` says otherwise. Either way the model's paged cache is allocated over the pool at once, so capacity
and `kv_bytes` are counted from what was allocated.

Decode steps of up to `cuda_graph_max_bs` requests replay CUDA graphs (engine/cuda_graphs.py) captured after the
pool is allocated; their memory is reserved before sizing it (one eager decode step of the largest captured size at
the widest page table, measured, plus the fp32 logits each graph keeps) and reported as `graph_bytes` once
captured (what their memory pool holds).

No request waits for a Triton compile. Capturing the graphs compiles the decode kernels; the `graph_capture` stage
then also runs the eager steps' shapes (`_warm_up`): Triton compiles a kernel variant per distinct constexpr and per
integer argument that is 1, a multiple of 16 or neither, and a prefill or mixed step's token count is anything up to
`max_num_batched_tokens`. The kernels take token counts unspecialised and pick tiles from the power of two above
them, so a prompt prefilled in chunks of every size up to 64 tokens and of 2^j - 1 and 2^j tokens beyond meets every
variant. A kernel variant made after boot anyway (compiled, or loaded from Triton's on-disk cache) is logged as
`kernel_compiled_after_boot`.

The MoE layers count the routed experts they read, per step kind (`ExpertCounts`, for /metrics).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
import triton

from engine.cache.layout import KVLayout
from engine.cache.pool import PagePool
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.model.loader import load_model
from engine.model.state import ForwardBatch, SequenceState
from engine.sampler import sample
from engine.scheduler import ScheduledWork
from engine.sequence import Sequence, TokenLogprob

log = structlog.get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every prefill chunk size up to this many tokens is warmed at boot, powers of two (and one less) beyond.
WARM_EVERY_SIZE_UP_TO = 64


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


# Triton converts to and from FP8 e4m3 only from compute capability 8.9 (Ada, Hopper, Blackwell).
FP8_COMPUTE_CAPABILITY = (8, 9)


def check_fp8_support(gpu: str, capability: tuple[int, int], kv_dtype: str, quant_sim: bool) -> None:
    """FP8 KV rows and quant_sim's FP8 rounding compile only for GPUs of compute capability 8.9 or newer: refuse an
    older GPU at start, before the weights load, rather than at the first kernel's compile minutes later."""
    needs = [what for what, on in (("kv_cache_dtype fp8_e4m3", kv_dtype == "fp8_e4m3"), ("quant_sim", quant_sim)) if on]
    if needs and capability < FP8_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"{gpu} has compute capability {capability[0]}.{capability[1]}; {' and '.join(needs)} "
            f"{'need' if len(needs) > 1 else 'needs'} 8.9 or newer "
            "(Ada, Hopper, Blackwell), where Triton has FP8 e4m3. Without them (kv_cache_dtype bfloat16, quant_sim "
            "off, which drops the official model's FP8/FP4 activation rounding) the engine is untested on this GPU"
        )


def under_wsl() -> bool:
    """WSL2's CUDA driver cannot pin much host memory, and pinned copies there fail or crawl."""
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def warm_up_chunks(budget: int, room: int) -> list[int]:
    """The chunk sizes of the boot warm-up's prompt: 1, 2, ..., WARM_EVERY_SIZE_UP_TO tokens, then 2^j - 1 and 2^j,
    then budget - 1 and budget (the step's token budget), none over room."""
    sizes = list(range(1, min(budget, WARM_EVERY_SIZE_UP_TO) + 1))
    for n in (*(1 << j for j in range(WARM_EVERY_SIZE_UP_TO.bit_length(), budget.bit_length())), budget):
        sizes += [m for m in (n - 1, n) if m > sizes[-1]]
    return [n for n in sizes if n <= room]


class ExpertCounts:
    """Per step kind (decode: one token per request; prefill: any step with prompt tokens) and MoE layer: the steps
    run, and the distinct routed experts the layer's tokens picked, summed over those steps (the expert weights a
    step reads). The MoE's counting sort adds them on the device, inside the decode graphs too (whose padding rows
    count as well: their experts are read); they are copied to the host only by `read`, so steps never wait."""

    KINDS = ("decode", "prefill")

    def __init__(self, moes: list, device: torch.device):
        self.moes = moes
        self.touched = torch.zeros(len(self.KINDS), len(moes), dtype=torch.int64, device=device)
        self.steps = [0] * len(self.KINDS)
        self._reader = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._kind: int | None = None
        self._point(0)  # the decode graphs keep the counters they are captured with

    def _point(self, kind: int) -> None:
        if kind != self._kind:
            for layer, moe in enumerate(self.moes):
                moe.touched = self.touched[kind, layer]
            self._kind = kind

    def count(self, decoding: bool) -> None:
        """A step of this kind is about to run (eagerly, or as a decode graph's replay)."""
        kind = 0 if decoding else 1
        self.steps[kind] += 1
        self._point(kind)

    def reset(self) -> None:
        self.touched.zero_()
        self.steps = [0] * len(self.KINDS)

    def read(self) -> dict[str, tuple[int, list[int]]]:
        """Per kind: (steps, experts touched per MoE layer). The device's counters are copied on a stream of their
        own, without waiting for the steps queued (the caller may be the server's event loop): exact when the engine
        is idle, and while it runs the steps counted may lead the experts counted by the steps in flight."""
        steps = list(self.steps)
        with torch.cuda.stream(self._reader):  # a no-op without one (CPU)
            touched = self.touched.cpu().tolist()
        return {kind: (steps[k], touched[k]) for k, kind in enumerate(self.KINDS)}


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
        if self.device.type == "cuda":
            check_fp8_support(torch.cuda.get_device_name(self.device), torch.cuda.get_device_capability(self.device),
                              layout_kv_dtype(config, self.device), config.quant_sim)  # fmt: skip
        torch.manual_seed(config.seed)

        started = time.monotonic()
        self.model = load_model(config.model, self.dtype, self.device, config.quant_sim, load_format=config.load_format)
        self.model.fuse_projections()
        if self.device.type == "cuda":
            weights_bytes = torch.cuda.memory_allocated(self.device)
        else:
            weights_bytes = sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])
        log.info("boot_stage", stage="weights", seconds=_since(started), bytes=weights_bytes, device=str(self.device))
        self.expert_counts = ExpertCounts([layer.ffn for layer in self.model.layers], self.device)

        started = time.monotonic()
        self.layout = KVLayout.for_model(self.model.args, config.page_size, layout_kv_dtype(config, self.device))
        self.context_length = context_length
        cuda = self.device.type == "cuda"
        graphs = cuda and not config.enforce_eager
        # Reserved before sizing the pool (CUDA): the largest admitted step's activations, and the decode graphs.
        self.workspace_bytes: int | None = None
        self.graph_reserve_bytes: int | None = None
        if cuda:
            num_pages = self._cuda_pool_pages(weights_bytes, graphs)
        else:
            num_pages = config.num_kv_pages or self.layout.pages_for(context_length) * config.max_num_seqs
        self.pool = PagePool(num_pages, config.page_size)
        # The cache over the pool's pages, with a window-ring slot for each running request (and one for the
        # graphs' padding rows).
        cache = self.model.allocate_kv_cache(self.pool, config.max_num_seqs + graphs, config.kv_cache_dtype)
        self.kv_cache_dtype = cache.kv_dtype
        # Every slot's page table, on the device, zero past its pages; a step uploads only the entries added since
        # the last (the first self._uploaded[s] pages of slot s are there).
        self.page_tables = torch.zeros(cache.num_slots, self.layout.pages_for(context_length), dtype=torch.int32,
                                       device=self.device)  # fmt: skip
        self._uploaded = [0] * cache.num_slots
        log.info(
            "boot_stage",
            stage="kv_alloc",
            seconds=_since(started),
            kv_pages=num_pages,
            kv_capacity_tokens=self.pool.capacity_tokens,
            kv_bytes=cache.bytes,
            kv_cache_dtype=self.kv_cache_dtype,
            workspace_bytes=self.workspace_bytes,
            graph_reserve_bytes=self.graph_reserve_bytes,
            pinned_host_memory=self.pin_memory,
        )

        started = time.monotonic()
        self.graphs: DecodeGraphs | None = None
        graph_bytes = 0 if cuda else None
        if graphs:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(self.model, config.cuda_graph_max_bs, self.layout.pages_for(context_length),
                                           pad_slot=cache.take_slot())  # fmt: skip
            graph_bytes = self.graphs.memory_bytes
        if cuda:
            warm_started = time.monotonic()
            chunks = self._warm_up()
            torch.cuda.empty_cache()
            _log_compiles_from_now()
            graph = {"batch_sizes": self.graphs.sizes, "bytes": graph_bytes} if graphs else {"skipped": "enforce_eager"}
            warm_up = {"warmup_seconds": _since(warm_started), "warmup_chunks": len(chunks),
                       "warmup_largest_chunk": chunks[-1]}  # fmt: skip
            log.info("boot_stage", stage="graph_capture", seconds=_since(started), **graph, **warm_up)
        else:  # nothing is compiled on the CPU
            log.info("boot_stage", stage="graph_capture", seconds=0.0, skipped="cpu")
        self.expert_counts.reset()  # boot's own steps are not served steps
        free, total = torch.cuda.mem_get_info(self.device) if cuda else (None, None)
        self.memory = MemoryReport(total, free, weights_bytes, cache.bytes, graph_bytes)

    def _cuda_pool_pages(self, weights_bytes: int, graphs: bool) -> int:
        config = self.config
        workspace, graph_bytes = self._peak_workspace_bytes(graphs)
        self.workspace_bytes, self.graph_reserve_bytes = workspace, graph_bytes
        free, total = torch.cuda.mem_get_info(self.device)
        budget = config.gpu_memory_utilization * total - (weights_bytes + graph_bytes + workspace)
        # Other processes may hold memory too: never plan past what is free now, less what steps and graphs need.
        budget = min(budget, free - workspace - graph_bytes)
        fixed = (config.max_num_seqs + graphs) * self.layout.per_sequence_state_bytes
        fit = int((budget - fixed) // self.layout.bytes_per_page)
        pages = config.num_kv_pages or fit
        if pages < 1 or pages > fit:
            raise RuntimeError(
                f"the KV pool does not fit: {pages} pages of {self.layout.bytes_per_page} B asked, room for {fit} "
                f"(gpu_memory_utilization {config.gpu_memory_utilization} of {total} B, weights {weights_bytes} B, "
                f"peak workspace {workspace} B for max_num_batched_tokens {config.max_num_batched_tokens}, "
                f"{graph_bytes} B for CUDA graphs up to batch {config.cuda_graph_max_bs}, "
                f"{fixed} B of per-request state for max_num_seqs {config.max_num_seqs}, {free} B free)"
            )
        return pages

    @torch.inference_mode()
    def _peak_workspace_bytes(self, graphs: bool) -> tuple[int, int]:
        """Peak memory of one step of the largest admitted shape, a `max_num_batched_tokens` prefill, and (when
        graphs are captured) of a decode step of the largest captured batch at the widest page table, over a cache
        just big enough (replaced by the real one right after)."""
        n, config = self.config.max_num_batched_tokens, self.config
        self.model.allocate_kv_cache(PagePool(self.layout.pages_for(n), config.page_size), 1, config.kv_cache_dtype)

        def peak_of(step) -> int:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            before = torch.cuda.memory_allocated(self.device)
            step()
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device) - before

        def prefill() -> None:
            state = self.model.new_state()
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            streams = self.model(ForwardBatch(ids, torch.arange(n, device=self.device), [state], [n]))
            self.model.logits(streams[-config.max_num_seqs :])
            self.model.release_state(state)

        sizes = capture_sizes(config.cuda_graph_max_bs)

        def decode() -> None:  # every row at position 0 of slot 0, as the graphs' padding rows run
            bs = sizes[-1]
            batch = ForwardBatch(torch.zeros(bs, dtype=torch.long, device=self.device),
                                 torch.zeros(bs, dtype=torch.long, device=self.device), [], [1] * bs)  # fmt: skip
            table = torch.zeros(bs, self.layout.pages_for(self.context_length), dtype=torch.int32, device=self.device)
            batch.set_tables(table, torch.zeros(bs, dtype=torch.int32, device=self.device))
            self.model.logits(self.model.run_layers(batch))

        workspace = peak_of(prefill)
        graph_bytes = 0
        if graphs:  # the largest graph's workspace, shared by all, and every graph's logits, which each keeps
            graph_bytes = peak_of(decode) + sum(sizes) * self.model.args.vocab_size * 4
        torch.cuda.empty_cache()
        return workspace, graph_bytes

    @torch.inference_mode()
    def _warm_up(self) -> list[int]:
        """Run the kernels of every eager step shape once (see the module's docstring): one prompt in chunks of 1,
        2, ..., WARM_EVERY_SIZE_UP_TO tokens, then of 2^j - 1 and 2^j tokens, and of max_num_batched_tokens - 1 and
        max_num_batched_tokens; each chunk's last rows, up to max_num_seqs of them, go through the head as the rows
        a step samples. A chunk that would pass the context length or the pool starts the prompt over (one that
        alone would is no step's). Returns the chunk sizes run."""
        config = self.config
        room = min(self.context_length, self.pool.capacity_tokens)
        sizes = warm_up_chunks(config.max_num_batched_tokens, room)
        state, position = self.model.new_state(), 0
        for n in sizes:
            if position + n > room:
                self.model.release_state(state)
                state, position = self.model.new_state(), 0
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            positions = torch.arange(position, position + n, device=self.device)
            streams = self.model(ForwardBatch(ids, positions, [state], [n]))
            self.model.logits(streams[-config.max_num_seqs :])
            position += n
        self.model.release_state(state)
        torch.cuda.synchronize(self.device)
        return sizes

    def release(self, state: SequenceState) -> None:
        """A finished or preempted request gives its cache slot (and pages) back; its page table row goes back to
        zeros (after the steps already queued have read it)."""
        self.page_tables[state.slot, : self._uploaded[state.slot]].zero_()
        self._uploaded[state.slot] = 0
        self.model.release_state(state)

    def _to_device(self, values: list[int]) -> torch.Tensor:
        """One host-to-device copy that does not wait for the device (from pinned memory, which the caching host
        allocator keeps until the copy is done)."""
        tensor = torch.tensor(values, dtype=torch.long)
        if self.pin_memory:
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)

    @torch.inference_mode()
    def launch(self, work: list[ScheduledWork], previous: LaunchedStep | None) -> LaunchedStep:
        """Queue one step on the device: each scheduled request advances by its tokens, and those whose prompt is
        now complete sample their next token. Nothing here waits for the device: a request whose last token is
        still in flight (sampled by `previous`, not yet read) takes it from `previous`'s tokens on the device, and
        the batch's host data goes over in one copy: input ids, positions, slots, the rows of its page tables that
        grew since the last step (kept per slot on the device), and the rows to sample."""
        ids, positions, slots, lens, states = [], [], [], [], []
        src, dst = [], []  # rows of `previous`'s tokens -> rows of this step's input ids
        table_at, table_pages = [], []  # new entries of the page tables, as flat indices into self.page_tables
        last_rows, sampled = [], []
        width = self.page_tables.shape[1]
        for item in work:
            seq, n = item.seq, item.num_tokens
            if seq.state is None:
                seq.state = self.model.new_state(seq.page_table)
            state, start = seq.state, seq.num_computed
            if state.num_tokens != start:
                raise ValueError(f"request continues at position {start} but has processed {state.num_tokens} tokens")
            if seq.num_in_flight:  # one decode row: its token is the one `previous` sampled
                src.append(previous.rows[seq.request_id])
                dst.append(len(ids))
                ids.append(0)
            else:
                ids += seq.token_ids(start, start + n)
            positions += range(start, start + n)
            pages, uploaded = state.table.pages, self._uploaded[state.slot]
            if len(pages) > uploaded:
                table_at += range(state.slot * width + uploaded, state.slot * width + len(pages))
                table_pages += pages[uploaded:]
                self._uploaded[state.slot] = len(pages)
            slots.append(state.slot)
            lens.append(n)
            states.append(state)
            if item.completes_prompt:
                last_rows.append(len(ids) - 1)
                sampled.append(seq)
        parts = [ids, positions, slots, src, dst, table_at, table_pages, last_rows]
        data = self._to_device([v for part in parts for v in part]).split([len(part) for part in parts])
        input_ids, positions_d, slots_d, src_d, dst_d, table_at_d, table_pages_d, last_rows_d = data
        if table_at:
            self.page_tables.view(-1).index_copy_(0, table_at_d, table_pages_d.int())
        if src:
            input_ids.index_copy_(0, dst_d, previous.tokens.index_select(0, src_d))
        batch = ForwardBatch(input_ids, positions_d, states, lens)
        used = max(len(state.table.pages) for state in states)
        batch.set_tables(self.page_tables[:, :used].index_select(0, slots_d), slots_d.int())
        self.expert_counts.count(batch.decoding)
        if self.graphs is not None and self.graphs.fits(batch):
            # A one-token chunk of a longer prompt also runs as a decode row; it does not sample.
            logits = self.graphs.replay(batch)
            if len(last_rows) < len(states):
                logits = logits.index_select(0, last_rows_d)
        else:
            streams = self.model.run_layers(batch)
            logits = self.model.logits(streams.index_select(0, last_rows_d)) if sampled else None
        self.model.advance(batch)
        for item in work:
            item.seq.num_computed += item.num_tokens
        for seq in sampled:
            seq.num_in_flight += 1
        if not sampled:
            return LaunchedStep([], results=[])
        if all(seq.params.greedy and seq.params.constraint is None and seq.params.logprobs is None for seq in sampled):
            # Plain greedy: the argmax stays on the device for the next step; the host reads M ids, not M x vocab.
            return LaunchedStep(sampled, tokens=logits.argmax(dim=-1), pin_memory=self.pin_memory)
        logits = logits.cpu()
        results: list[tuple[int, TokenLogprob | None] | Exception] = []
        for row, seq in enumerate(sampled):
            try:
                results.append(sample(logits[row], seq.params, seq.generator, seq.remaining_output))
            except Exception as error:  # its grammar or its numbers: this request fails alone (llm_engine.py)
                results.append(error)
        return LaunchedStep(sampled, results=results)

    def synchronize(self) -> None:
        """Wait for the device; a broken one (a sticky CUDA error) raises here."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class LaunchedStep:
    """A step queued on the device: the requests it samples a token for, in order, and those tokens. Tokens sampled on
    the host (seeds, temperature, logprobs, constraints) are known at once; greedy ones stay on the device
    (`tokens`, which the next step reads) until `results()` waits for this step alone."""

    def __init__(
        self,
        seqs: list[Sequence],
        tokens: torch.Tensor | None = None,
        results: list[tuple[int, TokenLogprob | None] | Exception] | None = None,
        pin_memory: bool = False,
    ):
        self.seqs, self.tokens, self._results = seqs, tokens, results
        self.rows = {seq.request_id: row for row, seq in enumerate(seqs)}
        self._host, self._done = tokens, None
        if tokens is not None and tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=pin_memory)
            self._host.copy_(tokens, non_blocking=pin_memory)
            self._done = torch.cuda.Event()
            self._done.record()

    @property
    def on_device(self) -> bool:
        """Its tokens are still to be read: the host may queue the next step first."""
        return self._results is None

    def results(self) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """(token, logprob record) per request of `seqs`, or what failed its sampling; waits for this step's tokens,
        not for later steps."""
        if self._results is None:
            if self._done is not None:
                self._done.synchronize()
            self._results = [(token, None) for token in self._host.tolist()]
        return self._results


def kernel_variant(fn, compile: dict) -> dict:
    """What tells a compiled kernel variant from another (a `jit_post_compile_hook`'s fn and compile): the constexpr
    and specialised values, and which arguments were taken as 16-divisible (pointer alignment, strides)."""
    names = fn.jit_function.arg_names
    aligned = sorted(names[i[0]] for i, attrs in compile["configs"][0].items() if ["tt.divisibility", 16] in attrs)
    constants = {names[i[0]] if isinstance(i, tuple) else i: v for i, v in compile["constants"].items()}
    return dict(kernel=fn.name, num_warps=compile["num_warps"], num_stages=compile["num_stages"],
                constants=str(constants), aligned=",".join(aligned))  # fmt: skip


def _log_compiles_from_now() -> None:
    """Boot has made the kernel variants steps need; from now on each one made (compiled, or loaded from Triton's
    on-disk cache), which delays the step that needs it, is logged with its specialisation."""

    def made(*, fn, compile, **_) -> None:
        log.warning("kernel_compiled_after_boot", **kernel_variant(fn, compile))

    triton.knobs.runtime.jit_post_compile_hook = made


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
