"""Boot: everything the engine does once, before it serves — device checks, the weights, the KV pool's size and
allocation, the decode graphs' capture and the warm-up of the eager step shapes — logged as the boot stages
`weights`, `kv_alloc` and `graph_capture`. What it makes (`Booted`) is what the per-device step runner
(engine/model_runner.py) runs steps on. Over several ranks (engine/parallel.py) every rank boots its own part of
the model (`Layout.for_rank`) on its own GPU, in lockstep: the sizing, warm-up and capture steps issue the
model's collectives, and the ranks agree on one pool size (the smallest that fits every GPU).

KV pool sizing. On CUDA the pool gets what `gpu_memory_utilization` leaves after the weights, the CUDA-graph pool
and the peak workspace of the largest step the scheduler admits (`max_num_batched_tokens` tokens, whatever
`max_num_seqs` is), all measured with torch.cuda's memory counters, less `max_num_seqs` requests' fixed state
(window rings, compressor states). On CPU the pool holds `max_num_seqs` requests at full `context_length` unless
`num_kv_pages` says otherwise. Either way the paged cache is allocated at once, here, and bound to the model's
layers, so capacity and `kv_bytes` are counted from what was allocated; which pages and slots a request holds is
the scheduler's block manager's business.

Decode steps of up to `cuda_graph_max_bs` requests replay CUDA graphs (engine/cuda_graphs.py) captured after the
pool is allocated; their memory is reserved before sizing it (one eager decode step of the largest captured size at
the widest page table, measured, plus the fp32 logits each graph keeps) and reported as `graph_bytes` once
captured (what their memory pool holds).

No request waits for a Triton compile. Capturing the graphs compiles the decode kernels; the `graph_capture` stage
then also runs the eager steps' shapes (`_warm_up`): Triton compiles a kernel variant per distinct constexpr and per
integer argument that is 1, a multiple of 16 or neither, and a prefill or mixed step's token count is anything up to
`max_num_batched_tokens`. The kernels take token counts unspecialised and pick tiles from the power of two above
them, so a prompt prefilled in chunks of every size up to 64 tokens and of 2^j - 1 and 2^j tokens beyond meets every
variant; chunks of every row count a plain GEMM runs at (gemm_rows) also leave cuBLAS a kernel chosen for each. A
kernel variant made after boot anyway (compiled, or loaded from Triton's on-disk cache) is logged as
`kernel_compiled_after_boot`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import structlog
import torch
import triton

from engine.cache.kv_cache import ModelKVCache, kv_dtype_for
from engine.cache.layout import KVLayout
from engine.config import EngineConfig
from engine.cuda_graphs import DecodeGraphs, capture_sizes
from engine.kernels.dispatch import gemm_rows
from engine.model.args import ModelArgs
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.linear import Layout
from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.model.weight_formats import Formats
from engine.model_runner import ExpertCounts
from engine.standalone import Standalone

if TYPE_CHECKING:
    from engine.parallel import RankGroup

log = structlog.get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Every prefill chunk size up to this many tokens is warmed at boot, powers of two (and one less) beyond.
WARM_EVERY_SIZE_UP_TO = 64


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """The rank's device: CUDA device `rank` of those visible (CUDA_VISIBLE_DEVICES picks them), or the CPU."""
    kind = config.device if config.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if visible == 0:
        raise RuntimeError("device 'cuda' was asked for but no CUDA device is visible")
    if config.tensor_parallel_size > visible:
        raise RuntimeError(
            f"tensor_parallel_size {config.tensor_parallel_size} needs as many GPUs; {visible} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


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


def check_fp8_support(gpu: str, capability: tuple[int, int], kv_dtype: str, quant_sim: bool,
                      quantized_weights: bool = False) -> None:  # fmt: skip
    """FP8 KV rows, quant_sim's FP8 rounding and weights kept in FP8 / MXFP4 compile only for GPUs of compute
    capability 8.9 or newer: refuse an older GPU at start, before the weights load, rather than at the first
    kernel's compile minutes later."""
    settings = (("kv_cache_dtype fp8_e4m3", kv_dtype == "fp8_e4m3"), ("quant_sim", quant_sim),
                ("weight_formats as_stored (FP8 / MXFP4 weights)", quantized_weights))  # fmt: skip
    needs = [what for what, on in settings if on]
    if needs and capability < FP8_COMPUTE_CAPABILITY:
        raise RuntimeError(
            f"{gpu} has compute capability {capability[0]}.{capability[1]}; "
            f"{' and '.join([', '.join(needs[:-1]), needs[-1]] if len(needs) > 1 else needs)} "
            f"{'need' if len(needs) > 1 else 'needs'} 8.9 or newer "
            "(Ada, Hopper, Blackwell), where Triton has FP8 e4m3. Without them (kv_cache_dtype bfloat16, quant_sim "
            "off, which drops the official model's FP8/FP4 activation rounding, weight_formats dequantized) the "
            "engine is untested on this GPU"
        )


def padding_slots(graphs: bool, parallel: Layout) -> int:
    return int(graphs or parallel.data_parallel)


def state_slots(config: EngineConfig, graphs: bool, parallel: Layout) -> int:
    """Slots of window rings and compressor states: the requests', padding rows', and with prefix caching two
    snapshots a request (a prompt's and an output's; finished requests' stay cached in them until needed)."""
    snapshots = 2 * config.max_num_seqs if config.prefix_cache else 0
    return config.max_num_seqs + padding_slots(graphs, parallel) + snapshots


def check_split(config: EngineConfig) -> None:
    """Before any rank starts: the model splits over tensor_parallel_size ranks as `attention` says (heads by whole
    output groups, experts evenly), or a ValueError names what does not split. Rank 0's layers are built on the
    meta device, which allocates nothing."""
    args = ModelArgs.from_model_dir(config.model)
    formats = Formats.for_model_dir(config.model, config.weight_formats)
    with torch.device("meta"):
        DeepseekV4(args, formats=formats, layout=Layout.for_rank(config.attention, 0, config.tensor_parallel_size))


def under_wsl() -> bool:
    """WSL2's CUDA driver cannot pin much host memory, and pinned copies there fail or crawl."""
    try:
        return "microsoft" in Path("/proc/version").read_text().lower()
    except OSError:
        return False


def warm_up_chunks(budget: int, room: int) -> list[int]:
    """The chunk sizes of the boot warm-up's prompt: 1, 2, ..., WARM_EVERY_SIZE_UP_TO tokens, then 2^j - 1 and 2^j,
    every row count a plain GEMM runs at (engine/kernels/dispatch.py's gemm_rows: 8 an octave), and budget - 1 and
    budget (the step's token budget, whose GEMM row count covers the chunks above the last of those sizes), none over
    room."""
    sizes = set(range(1, min(budget, WARM_EVERY_SIZE_UP_TO) + 1)) | {budget - 1, budget}
    sizes |= {m for j in range(WARM_EVERY_SIZE_UP_TO.bit_length(), budget.bit_length()) for m in ((1 << j) - 1, 1 << j)}
    sizes |= {gemm_rows(n) for n in range(1, budget + 1)}
    return sorted(n for n in sizes if 0 < n <= min(budget, room))


@dataclass(frozen=True)
class MemoryReport:
    """GPU memory as /server_info reports it, measured at boot; None where there is no GPU to measure."""

    total_bytes: int | None
    free_bytes: int | None  # after every allocation, when the engine became ready
    weights_bytes: int
    kv_bytes: int  # as allocated: the pool's pages plus every running slot's window ring and compressor state
    graph_bytes: int | None


@dataclass
class Booted:
    """What boot made, for the step runner: the model on its device with the paged cache bound to its layers, the
    decode graphs (None when eager), and the figures /server_info reports."""

    config: EngineConfig
    context_length: int
    device: torch.device
    parallel: Layout  # this rank's part of the model
    dtype: torch.dtype
    pin_memory: bool  # host-to-device copies from pinned memory (not under WSL2, whose driver pins little)
    model: DeepseekV4
    expert_counts: ExpertCounts
    layout: KVLayout
    kv: ModelKVCache
    num_pages: int
    kv_cache_dtype: str
    # Slots of the cache: max_num_seqs for requests, then one for padding rows when the decode graphs or an idle
    # data-parallel rank need them, then the prefix cache's snapshots.
    num_slots: int
    snapshot_slots: range
    graphs: DecodeGraphs | None
    memory: MemoryReport


def boot(config: EngineConfig, context_length: int, ranks: RankGroup | None = None) -> Booted:
    rank, size = (ranks.rank, ranks.size) if ranks is not None else (0, 1)
    parallel = Layout.for_rank(config.attention, rank, size)
    device = resolve_device(config, rank)
    dtype = resolve_dtype(config, device)
    cuda = device.type == "cuda"
    if cuda:
        formats = Formats.for_model_dir(config.model, config.weight_formats)
        check_fp8_support(torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device),
                          layout_kv_dtype(config, device), config.quant_sim, formats != Formats())  # fmt: skip
    torch.manual_seed(config.seed)

    started = time.monotonic()
    model = load_model(config.model, dtype, device, config.quant_sim, load_format=config.load_format,
                       weight_formats=config.weight_formats, layout=parallel)  # fmt: skip
    if cuda:
        weights_bytes = torch.cuda.memory_allocated(device)
    else:
        weights_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    log.info("boot_stage", stage="weights", seconds=_since(started), bytes=weights_bytes, device=str(device))
    expert_counts = ExpertCounts([layer.ffn for layer in model.layers], device)

    started = time.monotonic()
    layout = KVLayout.for_model(model.args, config.page_size, layout_kv_dtype(config, device))
    graphs = cuda and not config.enforce_eager
    # Reserved before sizing the pool (CUDA): the largest admitted step's activations, and the decode graphs.
    workspace_bytes = graph_reserve_bytes = None
    if cuda:
        workspace_bytes, graph_reserve_bytes = _peak_workspace_bytes(model, config, layout, context_length, graphs)
        num_pages = _cuda_pool_pages(config, layout, device, weights_bytes, workspace_bytes, graph_reserve_bytes,
                                     state_slots(config, graphs, parallel))  # fmt: skip
    else:
        num_pages = config.num_kv_pages or layout.pages_for(context_length) * config.max_num_seqs
    if ranks is not None:  # tensor-parallel ranks run the same page tables; data-parallel ones warm up alike
        num_pages = min(ranks.gather(num_pages))
    # The cache's pages, and a window-ring slot for each running request (and one for padding rows).
    kv_dtype = kv_dtype_for(config.kv_cache_dtype, device, dtype)
    cache = ModelKVCache(model.args, num_pages, config.page_size, state_slots(config, graphs, parallel), kv_dtype,
                         device)  # fmt: skip
    snapshots = range(config.max_num_seqs + padding_slots(graphs, parallel), cache.num_slots)
    model.bind_kv_cache(cache)
    log.info(
        "boot_stage",
        stage="kv_alloc",
        seconds=_since(started),
        kv_pages=num_pages,
        kv_capacity_tokens=num_pages * config.page_size,
        kv_bytes=cache.bytes,
        kv_cache_dtype=cache.kv_dtype,
        workspace_bytes=workspace_bytes,
        graph_reserve_bytes=graph_reserve_bytes,
        pinned_host_memory=cuda and not under_wsl(),
    )

    started = time.monotonic()
    decode_graphs: DecodeGraphs | None = None
    graph_bytes = 0 if cuda else None
    if graphs:
        with torch.inference_mode():
            decode_graphs = DecodeGraphs(model, config.cuda_graph_max_bs, layout.pages_for(context_length),
                                         pad_slot=config.max_num_seqs)  # fmt: skip
        graph_bytes = decode_graphs.memory_bytes
    if cuda:
        warm_started = time.monotonic()
        chunks = _warm_up(Standalone(model, cache), config, min(context_length, num_pages * config.page_size))
        torch.cuda.empty_cache()
        _log_compiles_from_now()
        graph = {"batch_sizes": decode_graphs.sizes, "bytes": graph_bytes} if graphs else {"skipped": "enforce_eager"}
        warm_up = {"warmup_seconds": _since(warm_started), "warmup_chunks": len(chunks),
                   "warmup_largest_chunk": chunks[-1]}  # fmt: skip
        log.info("boot_stage", stage="graph_capture", seconds=_since(started), **graph, **warm_up)
    else:  # nothing is compiled on the CPU
        log.info("boot_stage", stage="graph_capture", seconds=0.0, skipped="cpu")
    expert_counts.reset()  # boot's own steps are not served steps
    free, total = torch.cuda.mem_get_info(device) if cuda else (None, None)
    return Booted(
        config=config,
        context_length=context_length,
        device=device,
        parallel=parallel,
        dtype=dtype,
        pin_memory=cuda and not under_wsl(),
        model=model,
        expert_counts=expert_counts,
        layout=layout,
        kv=cache,
        num_pages=num_pages,
        kv_cache_dtype=cache.kv_dtype,
        num_slots=cache.num_slots,
        snapshot_slots=snapshots,
        graphs=decode_graphs,
        memory=MemoryReport(total, free, weights_bytes, cache.bytes, graph_bytes),
    )


def _cuda_pool_pages(
    config: EngineConfig,
    layout: KVLayout,
    device: torch.device,
    weights_bytes: int,
    workspace: int,
    graph_bytes: int,
    slots: int,
) -> int:
    free, total = torch.cuda.mem_get_info(device)
    budget = config.gpu_memory_utilization * total - (weights_bytes + graph_bytes + workspace)
    # Other processes may hold memory too: never plan past what is free now, less what steps and graphs need.
    budget = min(budget, free - workspace - graph_bytes)
    fixed = slots * layout.per_sequence_state_bytes
    fit = int((budget - fixed) // layout.bytes_per_page)
    pages = config.num_kv_pages or fit
    if pages < 1 or pages > fit:
        raise RuntimeError(
            f"the KV pool does not fit: {pages} pages of {layout.bytes_per_page} B asked, room for {fit} "
            f"(gpu_memory_utilization {config.gpu_memory_utilization} of {total} B, weights {weights_bytes} B, "
            f"peak workspace {workspace} B for max_num_batched_tokens {config.max_num_batched_tokens}, "
            f"{graph_bytes} B for CUDA graphs up to batch {config.cuda_graph_max_bs}, "
            f"{fixed} B of window and compressor state for {slots} slots (max_num_seqs {config.max_num_seqs}, padding, "
            f"prefix snapshots), {free} B free)"
        )
    return pages


@torch.inference_mode()
def _peak_workspace_bytes(
    model: DeepseekV4, config: EngineConfig, layout: KVLayout, context_length: int, graphs: bool
) -> tuple[int, int]:
    """Peak memory of one step of the largest admitted shape, a `max_num_batched_tokens` prefill, and (when graphs
    are captured) of a decode step of the largest captured batch at the widest page table, over a cache just big
    enough (replaced by the real one right after)."""
    n, device = config.max_num_batched_tokens, model.embed.weight.device
    alone = Standalone.allocate(model, layout.pages_for(n), 1, config.kv_cache_dtype, config.page_size)

    def peak_of(step) -> int:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    def prefill() -> None:
        state = alone.new_state()
        ids = torch.zeros(n, dtype=torch.long, device=device)
        streams = alone(ForwardBatch(ids, torch.arange(n, device=device), [state], [n]))
        model.logits(streams[-config.max_num_seqs :])
        alone.release_state(state)

    sizes = capture_sizes(config.cuda_graph_max_bs)

    def decode() -> None:  # every row at position 0 of slot 0, as the graphs' padding rows run
        bs = sizes[-1]
        batch = ForwardBatch(torch.zeros(bs, dtype=torch.long, device=device),
                             torch.zeros(bs, dtype=torch.long, device=device), [], [1] * bs)  # fmt: skip
        table = torch.zeros(bs, layout.pages_for(context_length), dtype=torch.int32, device=device)
        batch.set_tables(table, torch.zeros(bs, dtype=torch.int32, device=device))
        model.logits(model.run_layers(batch))

    workspace = peak_of(prefill)
    graph_bytes = 0
    if graphs:  # the largest graph's workspace, shared by all, and every graph's logits, which each keeps
        graph_bytes = peak_of(decode) + sum(sizes) * model.args.vocab_size * 4
    torch.cuda.empty_cache()
    return workspace, graph_bytes


@torch.inference_mode()
def _warm_up(model: Standalone, config: EngineConfig, room: int) -> list[int]:
    """Run the kernels of every eager step shape once (see the module's docstring): one prompt in chunks of
    warm_up_chunks' sizes; each chunk's last rows, up to max_num_seqs of them, go through the head as the rows
    a step samples. A chunk that would pass `room` (the context length or the pool) starts the prompt over (one
    that alone would is no step's). Returns the chunk sizes run."""
    sizes = warm_up_chunks(config.max_num_batched_tokens, room)
    device = model.embed.weight.device
    state, position = model.new_state(), 0
    for n in sizes:
        if position + n > room:
            model.release_state(state)
            state, position = model.new_state(), 0
        ids = torch.zeros(n, dtype=torch.long, device=device)
        positions = torch.arange(position, position + n, device=device)
        streams = model(ForwardBatch(ids, positions, [state], [n]))
        model.logits(streams[-config.max_num_seqs :])
        position += n
    model.release_state(state)
    torch.cuda.synchronize(device)
    return sizes


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
