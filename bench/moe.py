"""The routed experts' grouped GEMM at DeepSeek-V4-Flash sizes (hidden 4096, expert intermediate 2048, 256 experts,
top-6, bf16 weights) on a CUDA GPU, against its bandwidth roofline.

Decode is weight streaming: a call must read each touched expert's w1, w3 and w2 once (50.3 MB an expert) plus the
activations. For batch 1, 16 and 64 this prints the time per call (eager, and replayed from a CUDA graph as the
decode step runs it), the bytes that must be read, the achieved bandwidth and its fraction of the copy bandwidth
measured in the same run (target >= 60% at batch 16 and 64). L2 stays cold: calls take turns over several routings
drawn at random (uniform top-6), so each call touches other experts, and even one call's experts exceed the L2.

    python bench/moe.py --out bench/results/moe.json
    python bench/moe.py --out bench/results/moe_sweep.json --sweep   # launch parameters instead
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, median_us  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from engine.kernels.moe import moe_experts_triton  # noqa: E402

E, K, D, INTER, LIMIT = 256, 6, 4096, 2048, 10.0
BATCHES = (1, 16, 64)
TURNS = 8  # routings taken in turn
DEV = torch.device("cuda")


def make_experts(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def normal(*shape):
        return torch.empty(*shape, dtype=torch.bfloat16, device=DEV).normal_(0, shape[-1] ** -0.5, generator=gen)

    return normal(E, INTER, D), normal(E, INTER, D), normal(E, D, INTER)


def make_routings(batch: int, gen: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """TURNS of (x [batch, D] bf16, weights [batch, K] fp32, ids [batch, K]): K distinct experts a token."""
    routings = []
    for _ in range(TURNS):
        x = torch.randn(batch, D, device=DEV, generator=gen).bfloat16()
        ids = torch.rand(batch, E, device=DEV, generator=gen).topk(K, dim=-1).indices
        weights = torch.rand(batch, K, device=DEV, generator=gen)
        routings.append((x, weights / weights.sum(-1, keepdim=True) * 1.5, ids))
    return routings


def bytes_to_read(routings) -> tuple[float, float]:
    """(touched experts, bytes), means over the routings: each touched expert's three matrices once, and the
    activations."""
    touched = sum(len(torch.unique(ids)) for _, _, ids in routings) / len(routings)
    activations = routings[0][0].numel() * routings[0][0].element_size()
    return touched, touched * 3 * INTER * D * 2 + activations


def time_in_turns(calls, reps: int = 40) -> float:
    turn = itertools.count()
    return median_us(lambda: calls[next(turn) % len(calls)](), reps=reps)


def graph_calls(experts, routings, **launch):
    """One CUDA graph a routing, each with its own static inputs: replaying in turn keeps L2 cold."""
    graphs = []
    for x, weights, ids in routings:
        moe_experts_triton(x, weights, ids, *experts, LIMIT, **launch)  # compile before capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            moe_experts_triton(x, weights, ids, *experts, LIMIT, **launch)
        graphs.append(graph.replay)
    return graphs


def eager_calls(experts, routings, **launch):
    return [lambda r=r: moe_experts_triton(*r, *experts, LIMIT, **launch) for r in routings]


def report(gen, experts, bandwidth: float) -> tuple[dict, list[str]]:
    results, lines = {}, ["## Routed-expert grouped GEMM, bf16, cold L2"]
    for batch in BATCHES:
        routings = make_routings(batch, gen)
        touched, need = bytes_to_read(routings)
        eager_us = time_in_turns(eager_calls(experts, routings))
        graph_us = time_in_turns(graph_calls(experts, routings))
        achieved = need / (graph_us * 1e-6)
        results[f"b{batch}"] = {"graph_us": graph_us, "eager_us": eager_us, "bytes": need, "touched_experts": touched,
                                "gb_s": achieved / 1e9, "fraction_of_copy": achieved / bandwidth}  # fmt: skip
        lines.append(f"batch {batch}: {graph_us:.1f} us in a graph ({eager_us:.1f} us eager), {touched:.1f} experts "
                     f"= {need / 1e9:.3f} GB, {achieved / 1e9:.0f} GB/s = {achieved / bandwidth:.0%} of copy "
                     "bandwidth (target >= 60% at batch 16 and 64)")  # fmt: skip
        torch.cuda.empty_cache()
    return results, lines


def sweep(gen, experts, bandwidth: float) -> tuple[dict, list[str]]:
    """Eager time of each launch configuration, batch by batch, best first."""
    results, lines = {}, ["## Launch parameters (eager, cold L2), best five a batch"]
    for batch in BATCHES:
        block_ms = [bm for bm in (16, 32, 64) if bm <= max(16, batch)]
        configs = [dict(block_m=bm, block_i=bi, block_d=bd, block_k=bk, num_warps=w, num_stages=s)
                   for bm, (bi, bd), bk, w, s in itertools.product(block_ms, [(16, 32), (32, 64), (64, 128)],
                                                                   [64, 128, 256], [4, 8], [3, 4, 5])]  # fmt: skip
        routings = make_routings(batch, gen)
        _, need = bytes_to_read(routings)
        timed = []
        for config in configs:
            try:
                us = time_in_turns(eager_calls(experts, routings, **config), reps=20)
            except OutOfResources:
                continue
            timed.append({**config, "us": us, "fraction_of_copy": need / (us * 1e-6) / bandwidth})
        timed.sort(key=lambda row: row["us"])
        results[f"b{batch}"] = timed
        lines += [f"batch {batch}: {row}" for row in timed[:5]]
    return results, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--sweep", action="store_true", help="time launch parameters instead of the report")
    args = parser.parse_args()
    gen = torch.Generator(device=DEV).manual_seed(0)
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    experts = make_experts(gen)
    results: dict = {"gpu": gpu, "copy_bandwidth_tb_s": bandwidth / 1e12}
    print(f"GPU: {gpu}; copy {bandwidth / 1e12:.2f} TB/s", flush=True)
    part, lines = (sweep if args.sweep else report)(gen, experts, bandwidth)
    results.update(part)
    print("\n".join(lines))
    results.update(provenance())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
