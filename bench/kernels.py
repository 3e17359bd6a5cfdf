"""Decode-time sparse-attention kernels at DeepSeek-V4-Flash shapes, on a CUDA GPU (the H200 of our targets).

Prints, in one run: the copy bandwidth and bf16 matmul rate measured here; the configured-maximum independence of
indexer + top-k + attention (1M-sized page tables / 8K-sized, batch 64, actual length 512); the speed-up against
the old fallback that scores every page up to the configured maximum; the FP8 indexer's fraction of the copy
bandwidth at 128K actual context (cold L2); top-k over 262,144 candidates; sparse attention against its roofline; and
a CUDA graph captured at the 1M maximum replayed at many actual lengths against eager runs.

    python bench/kernels.py --out bench/results   # writes kernels.json and kernels.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.plots import draw  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from engine.cache.kv_cache import IndexKeys, MainRows  # noqa: E402
from engine.kernels.dispatch import splits_for  # noqa: E402
from engine.kernels.indexer import indexer_logits_triton  # noqa: E402
from engine.kernels.sparse_attention import (  # noqa: E402
    FEW_REQUESTS,
    LAUNCHES,
    default_splits,
    sparse_decode_attention_triton,
)
from engine.kernels.topk import TopKWorkspace, topk_slots_triton  # noqa: E402

HEADS, HEAD_DIM, ROPE, WINDOW = 64, 512, 64, 128
INDEX_HEADS, INDEX_DIM, TOPK = 64, 128, 512
PAGE_TOKENS, C4_ROWS = 256, 64
DEV = torch.device("cuda")


def median_us(fn, reps: int = 50, warmup: int = 10) -> float:
    """Median time of fn() in µs with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def graph_us(fn, reps: int = 50) -> float:
    """Median µs of fn captured in a CUDA graph (how the serving runtime launches a decode step)."""
    fn()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_us(graph.replay, reps)


def copy_bandwidth() -> float:
    src = torch.empty(2 * 1024**3, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / (us * 1e-6)  # bytes read + written per second


def matmul_tflops() -> float:
    a = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=DEV, dtype=torch.bfloat16)
    us = median_us(lambda: a @ b, reps=10)
    return 2 * 8192**3 / (us * 1e-6) / 1e12


def fill_index_keys(keys: IndexKeys, gen: torch.Generator, chunk: int = 1 << 16) -> None:
    total = keys.storage.shape[0] * IndexKeys.rows_per_page if keys.fp8 else keys.storage.shape[0]
    for start in range(0, total, chunk):
        rows = torch.arange(start, min(total, start + chunk), device=DEV)
        keys.write(rows, torch.randn(len(rows), INDEX_DIM, device=DEV, generator=gen))


def fill_main_rows(rows: MainRows, n: int, gen: torch.Generator, chunk: int = 1 << 15) -> None:
    for start in range(0, n, chunk):
        slots = torch.arange(start, min(n, start + chunk), device=DEV)
        rows.write(slots, torch.randn(len(slots), HEAD_DIM, device=DEV, generator=gen))


class DecodeStep:
    """Indexer + top-k + sparse attention of one c4 layer for a batch, with buffers fixed for graph capture."""

    def __init__(self, batch: int, max_context: int, pool_pages: int, kv_dtype: str, gen: torch.Generator):
        self.batch, self.max_pages = batch, max_context // PAGE_TOKENS
        self.keys = IndexKeys(pool_pages, INDEX_DIM, kv_dtype, DEV)
        fill_index_keys(self.keys, gen)
        self.comp = MainRows(pool_pages, C4_ROWS, HEAD_DIM, ROPE, kv_dtype, DEV)
        fill_main_rows(self.comp, pool_pages * C4_ROWS, gen)
        self.ring = MainRows(batch, WINDOW, HEAD_DIM, ROPE, kv_dtype, DEV)
        fill_main_rows(self.ring, batch * WINDOW, gen)
        self.q_index = torch.randn(batch, INDEX_HEADS, INDEX_DIM, device=DEV, generator=gen).bfloat16()
        self.w = torch.randn(batch, INDEX_HEADS, device=DEV, generator=gen)
        self.q = torch.randn(batch, HEADS, HEAD_DIM, device=DEV, generator=gen).bfloat16()
        self.sink = torch.randn(HEADS, device=DEV, generator=gen)
        # Requests' pages spread over the pool; the table is sized for the configured maximum.
        self.page_table = torch.randint(0, pool_pages, (batch, self.max_pages), device=DEV, generator=gen).int()
        self.seq_slot = torch.arange(batch, device=DEV, dtype=torch.int32)
        self.positions = torch.zeros(batch, device=DEV, dtype=torch.int32)
        self.c4_len = torch.zeros(batch, device=DEV, dtype=torch.int32)
        self.comp_len = torch.zeros(batch, device=DEV, dtype=torch.int32)
        self.logits = torch.empty(batch, self.max_pages * C4_ROWS, device=DEV)
        self.slots = torch.empty(batch, TOPK, device=DEV, dtype=torch.int32)
        self.out = torch.empty(batch, HEADS, HEAD_DIM, device=DEV, dtype=torch.bfloat16)
        self.workspace = TopKWorkspace.allocate(batch, DEV)

    def set_length(self, tokens: int | list[int]) -> None:
        """Actual lengths in raw tokens; the query sits at the last position."""
        lengths = torch.tensor(tokens if isinstance(tokens, list) else [tokens] * self.batch, device=DEV)
        self.positions.copy_(lengths - 1)
        self.c4_len.copy_(lengths // 4)
        self.comp_len.copy_((lengths // 4).clamp(max=TOPK))

    def index(self) -> None:
        indexer_logits_triton(self.q_index, self.w, self.keys.values, self.keys.scales, self.page_table,
                              self.c4_len, self.logits)  # fmt: skip
        topk_slots_triton(self.logits, self.c4_len, self.page_table, TOPK, self.slots, self.workspace)

    def attend(self, **launch) -> None:
        """`launch`: splits= and launch= overrides (the wrapper picks them otherwise)."""
        sparse_decode_attention_triton(self.q, self.sink, HEAD_DIM**-0.5, self.ring.storage, self.seq_slot,
                                       self.positions, self.comp.storage, C4_ROWS, self.slots, self.comp_len,
                                       self.out, WINDOW, ROPE, **launch)  # fmt: skip

    def step(self) -> None:
        self.index()
        self.attend()


def fallback_index_topk(step: DecodeStep, max_pages: int):
    """The old O(configured maximum) path: score every row of every page up to max_pages, mask, then top-k."""
    rows = (step.page_table[:, :max_pages, None].long() * C4_ROWS + torch.arange(C4_ROWS, device=DEV)).flatten(1)
    keys = step.keys.values.reshape(-1, INDEX_DIM)[rows]  # [B, max_pages * 64, D]
    scores = torch.relu(torch.einsum("bhd,bnd->bhn", step.q_index, keys))
    logits = (scores.float() * step.w[:, :, None]).sum(1)
    valid = torch.arange(logits.shape[1], device=DEV)[None, :] < step.c4_len[:, None]
    return torch.topk(logits.masked_fill(~valid, float("-inf")), min(TOPK, logits.shape[1]), dim=-1)


def bench_independence_and_fallback(gen) -> tuple[dict, list[str]]:
    """Batch 64, actual 512 tokens, bf16 keys: 8K- vs 1M-sized page tables, and the old fallback."""
    small = DecodeStep(64, 8192, pool_pages=4096, kv_dtype="bfloat16", gen=gen)
    large = DecodeStep(64, 1 << 20, pool_pages=4096, kv_dtype="bfloat16", gen=gen)
    for step in (small, large):
        step.set_length(512)
    t8k, t1m = graph_us(small.step), graph_us(large.step)
    index_1m, index_1m_eager = graph_us(large.index), median_us(large.index)
    fallback = {m: median_us(lambda m=m: fallback_index_topk(large, m // PAGE_TOKENS), reps=10)
                for m in (8192, 131072, 1 << 20)}  # fmt: skip
    actual_only = median_us(lambda: fallback_index_topk(large, 2), reps=20)
    results = dict(
        decode_step_8k_us=t8k, decode_step_1m_us=t1m, max_context_independence_ratio=t1m / t8k,
        index_topk_1m_graph_us=index_1m, index_topk_1m_eager_us=index_1m_eager,
        fallback_index_topk_us={str(k): v for k, v in fallback.items()}, torch_actual_length_only_us=actual_only,
        speedup_vs_torch_fallback=fallback[1 << 20] / index_1m,
    )  # fmt: skip
    lines = [
        "## Configured-maximum independence (batch 64, actual 512 tokens, indexer + top-k + attention, graph)",
        f"8K-sized tables {t8k:.1f} us, 1M-sized {t1m:.1f} us: ratio {t1m / t8k:.3f} (target <= 1.10)",
        "## Against the old fallback (indexer + top-k, bf16 keys, batch 64, 512 actual)",
        *[f"fallback at {m // 1024}K configured: {v:.1f} us" for m, v in fallback.items()],
        f"plain torch over the actual length only: {actual_only:.1f} us",
        f"ours at 1M configured: {index_1m:.1f} us in a graph ({index_1m_eager:.1f} us eager): "
        f"{fallback[1 << 20] / index_1m:.0f}x faster (target >= 300x, <= 44 us)",
    ]
    return results, lines


def bench_indexer_bandwidth(gen, bandwidth: float) -> tuple[dict, list[str]]:
    """FP8 indexer at 128K actual context, batch 16 and 64, in a CUDA graph as a decode step runs it; the graph runs
    two pools in turn so L2 stays cold. Eager launches are reported beside: at these sizes Python's launch is as long
    as the kernel."""
    results, lines = {}, ["## FP8 indexer bandwidth, 128K actual, cold L2 (graph; eager launch in brackets)"]
    for batch in (16, 64):
        pages = batch * (131072 // PAGE_TOKENS)
        steps = [DecodeStep(batch, 131072, pages, "fp8_e4m3", gen) for _ in range(2)]
        for step in steps:
            step.page_table.copy_(torch.arange(pages, device=DEV).view(batch, -1).int())
            step.set_length(131072)

        def both(steps=steps):
            for s in steps:
                indexer_logits_triton(s.q_index, s.w, s.keys.values, s.keys.scales, s.page_table, s.c4_len, s.logits)

        us, eager_us = graph_us(both) / 2, median_us(both) / 2
        bytes_read = batch * (131072 // 4) * (INDEX_DIM + 4)
        fraction = bytes_read / (us * 1e-6) / bandwidth
        results[f"indexer_bandwidth_fraction_b{batch}"] = fraction
        results[f"indexer_128k_b{batch}_us"] = us
        results[f"indexer_128k_b{batch}_eager_us"] = eager_us
        lines.append(f"batch {batch}: {us:.1f} us ({eager_us:.1f} us eager), {bytes_read / us / 1e6:.2f} TB/s = "
                     f"{fraction:.0%} of copy bandwidth (target >= 60%)")  # fmt: skip
        del steps
        torch.cuda.empty_cache()
    return results, lines


def bench_topk(gen) -> tuple[dict, list[str]]:
    """Top-k over 262,144 candidates (1M actual), batch 1."""
    logits = torch.randn(1, 1 << 18, device=DEV, generator=gen)
    c4_len = torch.tensor([1 << 18], device=DEV, dtype=torch.int32)
    table = torch.arange(4096, device=DEV, dtype=torch.int32)[None]
    slots = torch.empty(1, TOPK, device=DEV, dtype=torch.int32)
    ws = TopKWorkspace.allocate(1, DEV)
    topk_us = graph_us(lambda: topk_slots_triton(logits, c4_len, table, TOPK, slots, ws))
    torch_us = median_us(lambda: torch.topk(logits, TOPK, dim=-1))
    topk_slots_triton(logits, c4_len, table, TOPK, slots, ws)
    exact = set(slots[0].tolist()) == set(torch.topk(logits[0], TOPK).indices.tolist())
    return dict(topk_1m_us=topk_us, torch_topk_1m_us=torch_us, topk_1m_exact=exact), [
        f"## Top-k 262144 -> 512, batch 1: {topk_us:.1f} us in a graph (torch.topk {torch_us:.1f} us); "
        f"same set as torch.topk: {exact} (target <= 50 us)"
    ]


def bench_attention(gen, bandwidth: float, tflops: float) -> tuple[dict, list[str]]:
    """c4 layer: 128 window + 512 selected rows, FP8 KV, batch 64, against max(bytes/BW, FLOPs/peak); and at batch
    1, 2, 4 (a lone agent's decode), the launch and split count picked for few requests against batch 64's launch
    with as many programs a request as fill the GPU (capped at 16), which few requests got before."""
    att = _attention_step(64, gen)
    us = graph_us(att.attend)
    rows = WINDOW + TOPK
    att_bytes = 64 * (rows * 584 + 2 * HEADS * HEAD_DIM * 2)
    att_flops = 64 * 2 * 2 * HEADS * rows * HEAD_DIM
    roofline = max(att_bytes / bandwidth, att_flops / (tflops * 1e12)) * 1e6
    results = dict(
        sparse_attention_us=us, sparse_attention_roofline_us=roofline, sparse_attention_roofline_fraction=roofline / us
    )  # fmt: skip
    lines = [
        f"## Sparse attention fp8, batch 64, 640 rows: {us:.1f} us; roofline {roofline:.1f} us = {roofline / us:.0%} "
        "(target >= 35%)", "",
        "| batch | picked launch, splits | us | batch 64's launch, GPU-filling splits | us | ratio |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    many = LAUNCHES[True, False][0]
    for batch in (1, 2, 4):
        att = _attention_step(batch, gen)
        splits = default_splits(batch, HEADS, rows, DEV)
        picked = LAUNCHES[True, batch <= FEW_REQUESTS][0]
        filling = splits_for(batch, DEV, waves=1, cap=16)
        ours = graph_us(att.attend)
        theirs = graph_us(lambda a=att, sp=filling: a.attend(splits=sp, launch=many))
        results[f"sparse_attention_b{batch}_us"] = ours
        results[f"sparse_attention_b{batch}_batch64_launch_us"] = theirs
        lines.append(f"| {batch} | {picked}, {splits} | {ours:.1f} | {many}, {filling} | {theirs:.1f} | "
                     f"{theirs / ours:.2f} |")  # fmt: skip
    return results, lines


def _attention_step(batch: int, gen) -> DecodeStep:
    att = DecodeStep(batch, 131072, pool_pages=max(batch, 8) * 512, kv_dtype="fp8_e4m3", gen=gen)
    att.set_length(131072)
    att.slots.copy_(torch.randint(0, max(batch, 8) * 512 * C4_ROWS, (batch, TOPK), device=DEV, generator=gen).int())
    return att


def check_graph_replay(gen) -> tuple[dict, list[str]]:
    """One graph captured at the 1M maximum, replayed at actual lengths, against eager runs."""
    step = DecodeStep(2, 1 << 20, pool_pages=2 * 4096, kv_dtype="fp8_e4m3", gen=gen)
    step.page_table.copy_(torch.arange(2 * 4096, device=DEV).view(2, -1).int())
    step.set_length(1)
    step.step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step.step()
    mismatches = []
    for length in GRAPH_LENGTHS:
        step.set_length([length, max(0, length - 1)])
        step.slots.fill_(-7)
        step.out.fill_(float("nan"))
        graph.replay()
        got_slots, got_out = step.slots.clone(), step.out.clone()
        step.slots.fill_(-7)
        step.step()
        same_sets = all(sorted(a) == sorted(b) for a, b in zip(got_slots.tolist(), step.slots.tolist(), strict=True))
        close = not got_out.isnan().any() and torch.allclose(got_out.float(), step.out.float(), atol=2e-2, rtol=2e-2)
        if not (same_sets and close):
            mismatches.append(length)
    verdict = f"mismatches at {mismatches}" if mismatches else "all match eager"
    return {"graph_replay_matches_eager": not mismatches}, [
        f"## Graph captured at 1M, replayed at {len(GRAPH_LENGTHS)} actual lengths: {verdict}"
    ]


def sweep(gen) -> tuple[dict, list[str]]:
    """Launch parameters of the three kernels at the target shapes; the defaults in engine/kernels come from here."""
    results, lines = {}, ["## Sweep"]
    for batch, split_counts in ((64, (1, 2, 3, 5)), (1, (5, 10, 16))):
        att = _attention_step(batch, gen)
        rows = []
        configs = [((hb, bn, nw, ns), sp) for hb, nw in ((64, 8), (32, 4), (32, 8), (16, 4)) for bn in (16, 32, 64)
                   for ns in (1, 2, 3) for sp in split_counts]  # fmt: skip
        for launch, splits in configs:
            try:
                us = graph_us(lambda a=att, lh=launch, sp=splits: a.attend(splits=sp, launch=lh), reps=20)
            except Exception as exc:  # a configuration that does not compile (registers, shared memory)
                lines.append(f"attention batch {batch} launch={launch} splits={splits}: {exc!s:.80}")
                continue
            rows.append((us, *launch, splits))
        rows.sort()
        results[f"attention_b{batch}_sweep"] = [dict(us=u, head_block=h, block_n=n, warps=w, stages=st, splits=sp)
                                                for u, h, n, w, st, sp in rows]  # fmt: skip
        lines += [f"attention batch {batch} hb={h} bn={n} w={w} stages={st} splits={sp}: {u:.1f} us"
                  for u, h, n, w, st, sp in rows[:8]]  # fmt: skip
    for batch in (16, 64):
        pages = batch * 512
        step = DecodeStep(batch, 131072, pages, "fp8_e4m3", gen)
        step.page_table.copy_(torch.arange(pages, device=DEV).view(batch, -1).int())
        step.set_length(131072)
        timed = []
        for waves in (4, 8, 16, 32):
            for warps in (4, 8):
                for stages in (2, 3, 4):
                    splits = max(1, waves * torch.cuda.get_device_properties(DEV).multi_processor_count // batch)
                    us = graph_us(lambda s=step, sp=splits, nw=warps, ns=stages: indexer_logits_triton(
                        s.q_index, s.w, s.keys.values, s.keys.scales, s.page_table, s.c4_len, s.logits, splits=sp,
                        num_warps=nw, num_stages=ns))  # fmt: skip
                    timed.append((us, waves, warps, stages))
        timed.sort()
        results[f"indexer_b{batch}_sweep"] = [dict(us=u, waves=v, warps=w, stages=st) for u, v, w, st in timed]
        lines += [f"indexer b{batch} waves={v} w={w} s={st}: {u:.1f} us" for u, v, w, st in timed[:5]]
    logits = torch.randn(1, 1 << 18, device=DEV, generator=gen)
    c4_len = torch.tensor([1 << 18], device=DEV, dtype=torch.int32)
    table = torch.arange(4096, device=DEV, dtype=torch.int32)[None]
    slots = torch.empty(1, TOPK, device=DEV, dtype=torch.int32)
    ws = TopKWorkspace.allocate(1, DEV)
    for splits in (64, 128, 256):
        us = graph_us(lambda sp=splits: topk_slots_triton(logits, c4_len, table, TOPK, slots, ws, splits=sp))
        results[f"topk_splits{splits}_us"] = us
        lines.append(f"top-k 1M splits={splits}: {us:.1f} us")
    return results, lines


GRAPH_LENGTHS = (0, 1, 3, 4, 5, 255, 256, 257, 4095, 4096, 4097, 131072, 1048575, 1048576)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sweep", action="store_true", help="time launch parameters instead of the report")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    gpu = torch.cuda.get_device_name()
    bandwidth, tflops = copy_bandwidth(), matmul_tflops()
    results: dict = {"gpu": gpu, "copy_bandwidth_tb_s": bandwidth / 1e12, "bf16_matmul_tflops": tflops}
    lines = [f"GPU: {gpu}; copy {bandwidth / 1e12:.2f} TB/s; bf16 matmul {tflops:.0f} TFLOP/s", ""]
    if args.sweep:
        part, text = sweep(gen)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "sweep.json").write_text(json.dumps(part, indent=2) + "\n")
        print("\n".join(text))
        return
    for section in (
        lambda: bench_independence_and_fallback(gen),
        lambda: bench_indexer_bandwidth(gen, bandwidth),
        lambda: bench_topk(gen),
        lambda: bench_attention(gen, bandwidth, tflops),
        lambda: check_graph_replay(gen),
    ):
        part, text = section()
        results.update(part)
        lines += text
        print("\n".join(text), flush=True)
        torch.cuda.empty_cache()
    results.update(provenance())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(results, indent=2) + "\n")
    header = [f"# Sparse-attention decode kernels — {results['date']}, {gpu}, commit {results['commit']}",
              f"torch {torch.__version__}, triton {triton.__version__}. Command: `python bench/kernels.py --out DIR`.",
              "", "![indexer + top-k per layer and step: the old fallback at 8K, 128K, 1M configured vs ours]"
              "(kernels.svg)", ""]  # fmt: skip
    (args.out / "kernels.md").write_text("\n".join(header + lines) + "\n")
    draw(args.out, only="kernels.json")


if __name__ == "__main__":
    main()
