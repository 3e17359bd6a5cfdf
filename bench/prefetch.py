"""Does asking for a GEMM's weights in L2 ahead of it pay, when latency-bound kernels run in between (a decode
step's norms, routing, attention)? On the GPU: rotating copies of a V4-Flash weight (cold L2), each behind a stand-in
for such a stretch (torch.cuda._sleep, one thread spinning), with and without engine.kernels.prefetch's launch
before the stretch; the GEMM's own µs is the graph's time less the same graph without the GEMM.

    python bench/prefetch.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, median_us  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from bench.quant import COLD_BYTES, SHAPES, activations, fp8_weight, linear  # noqa: E402
from engine.kernels.prefetch import l2_prefetch  # noqa: E402

DEV = "cuda"
STRETCH_US = (0, 5, 10, 20, 40)
SM_HZ = 1.98e9  # the H100's and H200's boost clock: the stretches are nominal


def graph_us(steps) -> float:
    for step in steps:
        step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for step in steps:
            step()
    return median_us(graph.replay, reps=30) / len(steps)


def stretch_us(gemm, x, weights, cycles: int, prefetch: bool, with_gemm: bool) -> float:
    """µs a weight of: [the prefetch], the stretch, [the GEMM]."""
    launches = [l2_prefetch(w) for w in weights]  # their tables made before the capture

    def step(i):
        if prefetch:
            launches[i]()
        if cycles:
            torch.cuda._sleep(cycles)
        if with_gemm:
            gemm(x, *weights[i])

    return graph_us([lambda i=i: step(i) for i in range(len(weights))])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    bandwidth = copy_bandwidth()
    results, lines = {}, []
    for name in ("wq_b", "wo_a", "wo_b", "shared_w13"):
        n, k, _ = SHAPES[name]
        weights = [fp8_weight(n, k, gen) for _ in range(max(2, -(-COLD_BYTES // (n * k))))]
        for m in (1, 64):
            x = activations(name, m, gen)
            gemm = linear(name)
            for stretch in STRETCH_US:
                cycles = int(stretch * 1e-6 * SM_HZ)
                cold = stretch_us(gemm, x, weights, cycles, False, True) - stretch_us(
                    gemm, x, weights, cycles, False, False
                )
                warm = stretch_us(gemm, x, weights, cycles, True, True) - stretch_us(
                    gemm, x, weights, cycles, True, False
                )
                key = f"{name} m{m} stretch{stretch}"
                results[key] = {"cold_us": cold, "prefetched_us": warm}
                line = f"- {key}: GEMM {cold:.1f} µs cold, {warm:.1f} µs prefetched ({n * k / 1e6:.1f} MB)"
                print(line, flush=True)
                lines.append(line)
        del weights
        torch.cuda.empty_cache()
    report = {**provenance(), "gpu": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": bandwidth / 1e12,
              "results": results}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefetch.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / "prefetch.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
