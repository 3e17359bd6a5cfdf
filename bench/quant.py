"""DeepSeek-V4-Flash's weights as stored, on a CUDA GPU (the H200 of our targets): the FP8 block-scaled linears and
the MXFP4 routed experts, each against the roofline that matters, all ratios from one run.

- FP8 GEMM, each dense shape of a layer (reference §10: wq_a, wq_b, wkv, wo_a grouped 8 ways, wo_b, the shared
  expert's w1/w3 fused and w2): at M = 1, 16, 64 the bytes read (e4m3 weight, scales, activations) and written over
  the time, as a fraction of the copy bandwidth measured in the same run, with L2 cold (each timed graph calls the
  linear over rotating copies of the weight, more than the L2 holds); at M = 4096, TFLOP/s with the activations'
  quantization inside the time, beside cuBLAS's bf16 GEMM of the same shape in the same run.
- MXFP4 experts (256 x (2048 x 4096 gate/up, 4096 x 2048 down), top-6): at batch 1, 16, 64 the packed bytes of the
  experts routed (codes and scales) over the time of a CUDA graph, replayed in turns over routings drawn at random,
  as a fraction of the copy bandwidth; and launch parameters at batch 1 (K splits), 16 and 64. The same for NVFP4
  experts (NVIDIA's ModelOpt layout: e4m3 scales per 16 values and a global scale per expert and projection, upcast
  through e4m3 and fp32), over their own bytes.

    python bench/quant.py --out bench/results   # writes quant.json, quant.md and quant.svg
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, median_us  # noqa: E402
from bench.plots import bar_chart  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from engine.kernels.fp4_moe import LARGE_TILES, MX_BLOCK, PackedFp4, moe_expert_pairs_fp4_triton  # noqa: E402
from engine.kernels.fp8_gemm import fp8_block_grouped_linear_triton, fp8_block_linear_triton  # noqa: E402
from engine.kernels.quant import NVFP4_BLOCK  # noqa: E402

DEV = torch.device("cuda")
# name: (N, K, groups) of the weight as stored
SHAPES = {"wq_a": (1024, 4096, 1), "wq_b": (32768, 1024, 1), "wkv": (512, 4096, 1), "wo_a": (8192, 4096, 8),
          "wo_b": (4096, 8192, 1), "shared_w13": (4096, 4096, 1), "shared_w2": (4096, 2048, 1)}  # fmt: skip
TARGETED = ("wq_b", "wo_a", "wo_b", "shared_w13")  # the minimum is over these; wq_a, wkv are reported
DECODE_M, PREFILL_M = (1, 16, 64), 4096
E, TOP_K, D, INTER, LIMIT = 256, 6, 4096, 2048, 10.0
BATCHES, TURNS = (1, 16, 64), 8
COLD_BYTES = 256 * 1024**2  # rotating copies of a weight add up to at least this (the H200's L2 is 60 MB)


def graph_per_call_us(calls) -> float:
    """Median µs per call of one CUDA graph that makes every call once (a decode step's launches, L2 cold)."""
    for call in calls:
        call()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_us(graph.replay, reps=30) / len(calls)


def fp8_weight(n: int, k: int, gen: torch.Generator):
    """Random e4m3 codes and ue8m0 scales near 2**-8 (the values' distribution does not change the time)."""
    w = torch.randn(n, k, device=DEV, generator=gen).mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    raw = torch.randint(118, 123, (-(-n // 128), -(-k // 128)), device=DEV, generator=gen, dtype=torch.uint8)
    return w, raw.view(torch.float8_e8m0fnu)


def linear(name: str):
    return fp8_block_grouped_linear_triton if SHAPES[name][2] > 1 else fp8_block_linear_triton


def activations(name: str, m: int, gen: torch.Generator) -> torch.Tensor:
    n, k, groups = SHAPES[name]
    shape = (m, groups, k) if groups > 1 else (m, k)
    return torch.randn(*shape, device=DEV, generator=gen).bfloat16()


def fp8_decode(gen, bandwidth: float) -> tuple[dict, list[str]]:
    results, lines = {}, ["## FP8 block-scaled GEMM, decode (cold L2, CUDA graph), fraction of copy bandwidth", "",
                          "| shape | N x K | " + " | ".join(f"M={m}" for m in DECODE_M) + " |",
                          "|---|---|" + "---|" * len(DECODE_M)]  # fmt: skip
    for name, (n, k, groups) in SHAPES.items():
        weight_bytes = n * k + (-(-n // 128)) * (-(-k // 128))
        copies = max(2, -(-COLD_BYTES // weight_bytes))
        weights = [fp8_weight(n, k, gen) for _ in range(copies)]
        row = {}
        for m in DECODE_M:
            x = activations(name, m, gen)
            us = graph_per_call_us([functools.partial(linear(name), x, *w) for w in weights])
            moved = weight_bytes + x.numel() * 2 + m * n * 2
            row[f"m{m}"] = {"us": us, "bytes": moved, "fraction_of_copy": moved / (us * 1e-6) / bandwidth}
        results[name] = row
        cells = " | ".join(f"{row[f'm{m}']['fraction_of_copy']:.0%} ({row[f'm{m}']['us']:.1f} µs)" for m in DECODE_M)
        shape = f"{groups} x {n // groups} x {k}" if groups > 1 else f"{n} x {k}"
        lines.append(f"| {name} | {shape} | {cells} |")
        del weights
        torch.cuda.empty_cache()
    return results, lines


def fp8_prefill(gen) -> tuple[dict, list[str]]:
    results, lines = {}, ["", f"## FP8 block-scaled GEMM, prefill M = {PREFILL_M} (activation quantization inside)", "",
                          "| shape | ours TFLOP/s | cuBLAS bf16 TFLOP/s |", "|---|---|---|"]  # fmt: skip
    total_flop = total_us = total_bf16_us = 0.0
    for name, (n, k, groups) in SHAPES.items():
        weight, scale = fp8_weight(n, k, gen)
        x = activations(name, PREFILL_M, gen)
        us = median_us(functools.partial(linear(name), x, weight, scale), reps=20)
        dense = torch.randn(n, k, device=DEV, generator=gen).bfloat16()
        if groups > 1:
            xg, wg = x.transpose(0, 1), dense.view(groups, n // groups, k).transpose(1, 2)
            bf16_us = median_us(functools.partial(torch.bmm, xg, wg), reps=20)
        else:
            bf16_us = median_us(functools.partial(torch.matmul, x, dense.T), reps=20)
        flop = 2 * PREFILL_M * n * k
        results[name] = {"us": us, "tflops": flop / us / 1e6, "cublas_bf16_us": bf16_us,
                         "cublas_bf16_tflops": flop / bf16_us / 1e6}  # fmt: skip
        total_flop, total_us, total_bf16_us = total_flop + flop, total_us + us, total_bf16_us + bf16_us
        lines.append(f"| {name} | {flop / us / 1e6:.0f} | {flop / bf16_us / 1e6:.0f} |")
    results["flop_weighted_tflops"] = total_flop / total_us / 1e6
    results["cublas_bf16_flop_weighted_tflops"] = total_flop / total_bf16_us / 1e6
    lines.append(f"| all (FLOP-weighted) | {results['flop_weighted_tflops']:.0f} | "
                 f"{results['cublas_bf16_flop_weighted_tflops']:.0f} |")  # fmt: skip
    return results, lines


def make_experts(gen: torch.Generator, nvfp4: bool = False):
    """Random codes with ue8m0 scales near 2**-8 (MXFP4), or e4m3 scales in [1, 2) and global scales near 2**-9
    (NVFP4): the values' distribution does not change the time."""

    def packed(rows, cols):
        codes = torch.randint(0, 256, (E, rows, cols // 2), device=DEV, generator=gen, dtype=torch.uint8)
        if nvfp4:
            scale = torch.randint(0x38, 0x40, (E, rows, cols // NVFP4_BLOCK), device=DEV, generator=gen,
                                  dtype=torch.uint8)  # fmt: skip
            global_scale = torch.rand(E, device=DEV, generator=gen).add_(1).mul_(2.0**-9)
            return PackedFp4(codes, scale.view(torch.float8_e4m3fn), global_scale)
        scale = torch.randint(117, 121, (E, rows, cols // MX_BLOCK), device=DEV, generator=gen, dtype=torch.uint8)
        return PackedFp4(codes, scale.view(torch.float8_e8m0fnu))

    return packed(INTER, D), packed(INTER, D), packed(D, INTER)


def make_routings(batch: int, gen: torch.Generator):
    routings = []
    for _ in range(TURNS):
        x = torch.randn(batch, D, device=DEV, generator=gen).bfloat16()
        ids = torch.rand(batch, E, device=DEV, generator=gen).topk(TOP_K, dim=-1).indices
        weights = torch.rand(batch, TOP_K, device=DEV, generator=gen)
        routings.append((x, weights / weights.sum(-1, keepdim=True) * 1.5, ids))
    return routings


def expert_bytes(block: int) -> int:
    """One expert's codes and one-byte scales, one a `block` values (NVFP4's 12 bytes of global scales left out)."""
    return 3 * INTER * D // 2 + 3 * INTER * D // block


def fp4_bytes(routings, experts) -> tuple[float, float]:
    touched = sum(len(torch.unique(ids)) for _, _, ids in routings) / len(routings)
    x = routings[0][0]
    return touched, touched * expert_bytes(experts[0].block) + x.numel() * 2 + x.shape[0] * TOP_K * D * 2


def fp4_graphs(experts, routings, **launch):
    graphs = []
    for x, weights, ids in routings:
        moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT, **launch)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT, **launch)
        graphs.append(graph.replay)
    return graphs


def in_turns(calls, reps: int = 40) -> float:
    turn = itertools.count()
    return median_us(lambda: calls[next(turn) % len(calls)](), reps=reps)


SWEEP = [dict(block_i=64, block_d=64, block_k=128, num_warps=4, num_stages=4),
         dict(block_i=64, block_d=64, block_k=64, num_warps=4, num_stages=4),
         dict(block_i=64, block_d=64, block_k=256, num_warps=4, num_stages=3),
         dict(block_i=32, block_d=64, block_k=256, num_warps=4, num_stages=4),
         dict(block_i=128, block_d=128, block_k=128, num_warps=8, num_stages=3)]  # fmt: skip
# At one token 6 experts leave most of the GPU idle: splits of K (gate/up, down) and narrower tiles
SPLIT_SWEEP = [
    dict(splits_up=1, splits_down=1),
    dict(splits_up=2, splits_down=1),
    dict(splits_up=4, splits_down=1),
    dict(splits_up=2, splits_down=2),
    dict(splits_up=4, splits_down=2),
    dict(splits_up=8, splits_down=4),
    dict(block_i=32, splits_up=1, splits_down=1),
    dict(block_i=32, block_d=32, splits_up=2, splits_down=2),
]


def fp4_experts(gen, bandwidth: float) -> tuple[dict, list[str]]:
    experts, nv_experts = make_experts(gen), make_experts(gen, nvfp4=True)
    results, lines = {}, ["", "## MXFP4 routed experts (W4A16, upcast by bf16x2 PTX), CUDA graph, cold L2", ""]
    nv_lines = ["", "## NVFP4 routed experts (W4A16, upcast through e4m3 and fp32), CUDA graph, cold L2", ""]
    for batch in BATCHES:
        routings = make_routings(batch, gen)
        touched, need = fp4_bytes(routings, experts)
        us = in_turns(fp4_graphs(experts, routings))
        e4m3_us = in_turns(fp4_graphs(experts, routings, bf16x2=False))  # the upcast NVFP4 takes, for comparison
        achieved = need / (us * 1e-6)
        _, nv_need = fp4_bytes(routings, nv_experts)
        nv_us = in_turns(fp4_graphs(nv_experts, routings))
        nv_achieved = nv_need / (nv_us * 1e-6)
        results[f"b{batch}"] = {"graph_us": us, "touched_experts": touched, "bytes": need, "gb_s": achieved / 1e9,
                                "fraction_of_copy": achieved / bandwidth, "e4m3_route_us": e4m3_us,
                                "nvfp4": {"graph_us": nv_us, "bytes": nv_need, "gb_s": nv_achieved / 1e9,
                                          "fraction_of_copy": nv_achieved / bandwidth}}  # fmt: skip
        lines.append(f"- batch {batch}: {us:.1f} µs, {touched:.1f} experts = {need / 1e9:.3f} GB packed, "
                     f"{achieved / 1e9:.0f} GB/s = {achieved / bandwidth:.0%} of copy bandwidth; through e4m3 "
                     f"instead of bf16x2 {e4m3_us:.1f} µs ({us / e4m3_us:.2f}x the time)")  # fmt: skip
        nv_lines.append(f"- batch {batch}: {nv_us:.1f} µs, {nv_need / 1e9:.3f} GB packed (e4m3 scales per 16), "
                        f"{nv_achieved / 1e9:.0f} GB/s = {nv_achieved / bandwidth:.0%} of copy bandwidth")  # fmt: skip
    lines += nv_lines
    sweep = {}
    lines += ["", "Launch parameters (CUDA graph), fraction of copy bandwidth:", ""]
    for batch, configs in ((1, SPLIT_SWEEP), (16, SWEEP + SPLIT_SWEEP[1:2]), (64, SWEEP)):
        routings = make_routings(batch, gen)
        _, need = fp4_bytes(routings, experts)
        rows = []
        for config in configs:
            try:
                us = in_turns(fp4_graphs(experts, routings, **config), reps=20)
            except Exception as error:  # a launch that does not fit (shared memory, registers) is skipped
                rows.append({**config, "error": type(error).__name__})
                continue
            rows.append({**config, "us": us, "fraction_of_copy": need / (us * 1e-6) / bandwidth})
            lines.append(f"- batch {batch} {config}: {us:.1f} µs = {rows[-1]['fraction_of_copy']:.0%}")
        sweep[f"b{batch}"] = rows
    results["sweep"] = sweep
    return results, lines


PREFILL_TOKENS = (1536, 2048, 4096, 8192)  # a cached agent turn's new tokens .. a whole prefill chunk
SMALL_TILES = dict(block_m=64, block_i=64, block_d=64, num_warps=4)


def fp4_prefill(gen) -> tuple[dict, list[str]]:
    """The MXFP4 experts at prefill chunks: TFLOP/s of the tiles expert_tiles picks, beside 64-pair and 128-pair
    tiles forced."""
    experts = make_experts(gen)
    results = {}
    lines = ["", "## MXFP4 routed experts at prefill chunks, CUDA graph (TFLOP/s; 64-pair and 128-pair tiles forced "
             "beside expert_tiles' pick)", ""]  # fmt: skip
    for tokens in PREFILL_TOKENS:
        routings = make_routings(tokens, gen)
        flop = tokens * TOP_K * 3 * INTER * D * 2
        runs = {
            name: in_turns(fp4_graphs(experts, routings, **config), reps=10)
            for name, config in (("picked", {}), ("64-pair tiles", SMALL_TILES), ("128-pair tiles", LARGE_TILES))
        }
        results[f"t{tokens}"] = {name: {"us": us, "tflops": flop / us / 1e6} for name, us in runs.items()}
        lines.append(
            f"- {tokens} tokens ({tokens * TOP_K / E:.0f} pairs an expert): "
            + ", ".join(f"{name} {flop / us / 1e6:.0f} TFLOP/s ({us:.0f} µs)" for name, us in runs.items())
        )
        del routings
        torch.cuda.empty_cache()
    return results, lines


# The decode kernel's launch: tile height, K splits, warps, pipelining depth, K blocks an iteration ({}: the rules)
FP8_SWEEP = [
    {},
    dict(splits=1),
    dict(splits=8),
    dict(splits=16),
    dict(block_n=128),
    dict(block_n=128, num_warps=8),
    dict(num_stages=6),
]


def fp8_variants(gen, bandwidth: float) -> tuple[dict, list[str]]:
    """The decode kernel's launch parameters on the large shapes at M = 1 and 64."""
    results, lines = {}, ["", "Decode launch parameters ({} = the default rules):", ""]
    for name in ("wq_b", "wo_a", "wo_b", "shared_w13"):
        n, k, _ = SHAPES[name]
        weight_bytes = n * k
        weights = [fp8_weight(n, k, gen) for _ in range(max(2, -(-COLD_BYTES // weight_bytes)))]
        for m, config in itertools.product((1, 64), FP8_SWEEP):
            x = activations(name, m, gen)
            calls = [functools.partial(linear(name), x, *w, **config) for w in weights]
            try:
                us = graph_per_call_us(calls)
            except Exception as error:  # a launch that does not fit (shared memory) is skipped
                lines.append(f"- {name} M={m} {config}: {type(error).__name__}")
                continue
            fraction = (weight_bytes + x.numel() * 2 + m * n * 2) / (us * 1e-6) / bandwidth
            results[f"{name} m{m} {config}"] = fraction
            lines.append(f"- {name} M={m} {config}: {us:.1f} µs = {fraction:.0%}")
        del weights
        torch.cuda.empty_cache()
    return results, lines


def chart(summary: dict, decode: dict) -> str:
    groups = [(f"M={m}", [(name, decode[name][f"m{m}"]["fraction_of_copy"] * 100,
                           f"{decode[name][f'm{m}']['fraction_of_copy']:.0%}") for name in SHAPES])
              for m in DECODE_M]  # fmt: skip
    fp4 = [summary["fp4_moe"][f"b{b}"]["fraction_of_copy"] for b in BATCHES]
    groups.append(("MXFP4 experts", [(f"batch {b}", f * 100, f"{f:.0%}") for b, f in zip(BATCHES, fp4, strict=True)]))
    nv = [summary["fp4_moe"][f"b{b}"]["nvfp4"]["fraction_of_copy"] for b in BATCHES]
    groups.append(("NVFP4 experts", [(f"batch {b}", f * 100, f"{f:.0%}") for b, f in zip(BATCHES, nv, strict=True)]))
    subtitle = (f"cold L2, CUDA graphs; target 75%; prefill {summary['fp8_gemm_tflops_m4096']:.0f} TFLOP/s; "
                f"{summary['gpu']}, commit {summary['commit']}, {summary['date']}")  # fmt: skip
    return bar_chart("FP8 GEMM and FP4 experts: fraction of copy bandwidth", subtitle, groups, "% of copy bandwidth")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for quant.json, quant.md, quant.svg")
    parser.add_argument("--no-sweep", action="store_true", help="skip the launch-parameter tables")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    print(f"GPU: {gpu}; copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    decode, lines = fp8_decode(gen, bandwidth)
    print("\n".join(lines), flush=True)
    prefill, more = fp8_prefill(gen)
    print("\n".join(more), flush=True)
    lines += more
    fp4, more = fp4_experts(gen, bandwidth)
    print("\n".join(more), flush=True)
    lines += more
    fp4_chunks, more = fp4_prefill(gen)
    print("\n".join(more), flush=True)
    lines += more
    variants = {}
    if not args.no_sweep:
        variants, more = fp8_variants(gen, bandwidth)
        print("\n".join(more), flush=True)
        lines += more

    def minimum(m: int) -> float:
        return min(decode[name][f"m{m}"]["fraction_of_copy"] for name in TARGETED)

    summary = {
        "fp8_gemm_bw_fraction_m1": minimum(1),
        "fp8_gemm_bw_fraction_m16": minimum(16),
        "fp8_gemm_bw_fraction_m64": minimum(64),
        "fp8_gemm_tflops_m4096": prefill["flop_weighted_tflops"],
        "cublas_bf16_tflops_m4096": prefill["cublas_bf16_flop_weighted_tflops"],
        "fp4_moe_bw_fraction_b1": fp4["b1"]["fraction_of_copy"],
        "fp4_moe_bw_fraction_b16": fp4["b16"]["fraction_of_copy"],
        "fp4_moe_bw_fraction_b64": fp4["b64"]["fraction_of_copy"],
        **{f"nvfp4_moe_bw_fraction_b{b}": fp4[f"b{b}"]["nvfp4"]["fraction_of_copy"] for b in BATCHES},
        "gpu": gpu,
        "copy_bandwidth_tb_s": bandwidth / 1e12,
        **provenance(),
        "fp8_gemm": {"decode": decode, "prefill": prefill, "decode_variants": variants},
        "fp4_moe": fp4,
        "fp4_moe_prefill": fp4_chunks,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "quant.json").write_text(json.dumps(summary, indent=2) + "\n")
    head = [f"# FP8, MXFP4 and NVFP4 kernels on {gpu}", "",
            f"commit {summary['commit']}, {summary['date']}, torch {summary['torch']}, triton {summary['triton']}; "
            f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write, same run). `python bench/quant.py --out "
            "bench/results`.", "",
            f"- FP8 decode, min over {', '.join(TARGETED)}: M=1 {summary['fp8_gemm_bw_fraction_m1']:.0%}, M=16 "
            f"{summary['fp8_gemm_bw_fraction_m16']:.0%}, M=64 {summary['fp8_gemm_bw_fraction_m64']:.0%} of copy "
            "bandwidth (target 75%)",
            f"- FP8 prefill M=4096: {summary['fp8_gemm_tflops_m4096']:.0f} TFLOP/s FLOP-weighted (target 600), "
            f"cuBLAS bf16 {summary['cublas_bf16_tflops_m4096']:.0f}",
            f"- MXFP4 experts: batch 1 {summary['fp4_moe_bw_fraction_b1']:.0%}, 16 "
            f"{summary['fp4_moe_bw_fraction_b16']:.0%}, 64 {summary['fp4_moe_bw_fraction_b64']:.0%} of copy "
            "bandwidth (target 75% at 16 and 64)",
            f"- NVFP4 experts: batch 1 {summary['nvfp4_moe_bw_fraction_b1']:.0%}, 16 "
            f"{summary['nvfp4_moe_bw_fraction_b16']:.0%}, 64 {summary['nvfp4_moe_bw_fraction_b64']:.0%} of copy "
            "bandwidth",
            "- MXFP4 experts at prefill chunks: " + ", ".join(
                f"{tokens} tokens {fp4_chunks[f't{tokens}']['picked']['tflops']:.0f}" for tokens in PREFILL_TOKENS)
            + " TFLOP/s", ""]  # fmt: skip
    (args.out / "quant.md").write_text("\n".join(head + lines) + "\n")
    (args.out / "quant.svg").write_text(chart(summary, decode))
    print("\n".join(head))


if __name__ == "__main__":
    main()
