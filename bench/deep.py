"""The deepest DeepSeek-V4-Flash-width model one GPU holds, booted as `python -m engine serve` boots it: the real
layer mix (the model's own first N layers, three hash-routed), all 256 experts in MXFP4 and the dense linears in FP8
as the official checkpoint stores them, made on the device by `--load-format dummy`, FP8 KV, sized for 1M-token
requests. It reports:

- boot time (weights, workspace probe, KV pool, warm-up, CUDA graphs) and the weights' bytes against the model's;
- the KV pool's capacity in tokens and in 1M-token requests;
- the decode step from the engine's CUDA graphs at batch 1, 16 and 64 (each request at 4096 tokens) against its
  roofline on the bytes read (bench/step.py's: dense weights, the distinct experts routed, the KV rows attended);
  per layer (the step less the head, over N) and the 43-layer step extrapolated (per layer x 43 + head);
- an 8192-token prompt's prefill, one step as the engine runs it (max_num_batched_tokens 8192), in tokens/s.

    python bench/deep.py --out bench/results            # writes deep.json, deep.md and deep.svg
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, median_us  # noqa: E402
from bench.plots import bar_chart  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from bench.shapes import FLASH_COMPRESS_RATIOS, write_model_dir  # noqa: E402
from bench.step import BATCHES, CONTEXT, decode_batch, roofline_bytes, touched_experts  # noqa: E402
from engine.boot import boot  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.model.state import ForwardBatch  # noqa: E402
from engine.standalone import Standalone  # noqa: E402

DEV = torch.device("cuda")
FULL_DEPTH, MAX_CONTEXT, PREFILL = len(FLASH_COMPRESS_RATIOS), 1 << 20, 8192


def head_us(model, batch_size: int) -> float:
    """The head (hc_head, norm, lm_head) alone for `batch_size` rows, replayed from a CUDA graph."""
    streams = torch.randn(batch_size, model.args.hc_mult, model.args.hidden_size, device=DEV, dtype=model.dtype)
    model.logits(streams)  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model.logits(streams)
    return median_us(graph.replay, reps=30)


def kernel_profile(replay, steps: int = 3) -> list[dict]:
    """Each kernel's GPU time and calls per step over `steps` graph replays (torch.profiler), longest first."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us > 0:
            rows.append({"kernel": event.key, "us_per_step": us / steps, "calls_per_step": event.count / steps})
    return sorted(rows, key=lambda row: -row["us_per_step"])


def prefill_seconds(alone: Standalone, gen: torch.Generator, reps: int = 3) -> float:
    """Median seconds of one PREFILL-token prompt run as a single step, its last token's logits included."""
    times = []
    for _ in range(reps):
        state = alone.new_state()
        ids = torch.randint(0, alone.args.vocab_size, (PREFILL,), generator=gen, device=DEV)
        batch = ForwardBatch(ids, torch.arange(PREFILL, device=DEV), [state], [PREFILL])
        torch.cuda.synchronize()
        started = time.perf_counter()
        alone.logits(alone(batch)[-1:])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
        alone.release_state(state)
    return sorted(times)[len(times) // 2]


def chart(results: dict) -> str:
    """The step from graphs beside its roofline, per batch, and the extrapolated 43-layer step."""
    groups = [(f"batch {b}", [("graph step", row["graph_us"] / 1e3, f"{row['graph_us'] / 1e3:.1f} ms"),
                              ("roofline", row["roofline_us"] / 1e3, f"{row['roofline_us'] / 1e3:.1f} ms"),
                              (f"{FULL_DEPTH} layers, extrapolated", row["extrapolated_step_ms"],
                               f"{row['extrapolated_step_ms']:.1f} ms")])
              for b, row in results["batches"].items()]  # fmt: skip
    subtitle = (f"{results['deep_layers']} of {FULL_DEPTH} layers, MXFP4 experts, FP8 dense; {results['gpu']}, "
                f"commit {results['commit']}, {results['date']}")  # fmt: skip
    return bar_chart("V4-Flash-width decode step on one GPU", subtitle, groups, "ms")


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for deep.json and deep.md")
    parser.add_argument("--layers", type=int, default=36, help=f"layers of the {FULL_DEPTH} (the deepest that fits)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.95)
    args = parser.parse_args()
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()), official_formats=True, layers=args.layers)
    config = EngineConfig(model=str(model_dir), load_format="dummy", context_length=MAX_CONTEXT,
                          max_num_seqs=max(BATCHES), cuda_graph_max_bs=max(BATCHES), prefix_cache=False,
                          gpu_memory_utilization=args.gpu_memory_utilization)  # fmt: skip
    started = time.monotonic()
    booted = boot(config, MAX_CONTEXT)
    boot_seconds = time.monotonic() - started
    model = booted.model
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    capacity = booted.num_pages * config.page_size
    weights = booted.memory.weights_bytes
    print(f"booted {args.layers} layers in {boot_seconds:.1f} s; weights {weights / 1e9:.2f} GB "
          f"({weights / tensor_bytes:.3f} of the tensors); KV {capacity} tokens", flush=True)  # fmt: skip
    alone = Standalone(model, booted.kv)  # its slots from 0: the graphs' padding slot (max_num_seqs) stays free
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: dict = {
        "gpu": gpu, "copy_bandwidth_tb_s": bandwidth / 1e12, "deep_layers": args.layers,
        "compress_ratios": model.args.compress_ratios, "boot_seconds": boot_seconds,
        "weights_bytes": weights, "weights_bytes_ratio": weights / tensor_bytes,
        "gpu_memory_utilization": args.gpu_memory_utilization, "kv_capacity_tokens": capacity,
        "kv_requests_at_1m": capacity / MAX_CONTEXT, "batches": {},
    }  # fmt: skip
    lines = ["| batch | graph µs/step | roofline µs | fraction | head µs | per layer µs | 43-layer step ms "
             "(extrapolated) | bytes: dense / experts / KV (MB) |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for batch_size in BATCHES:
        states, batch = decode_batch(alone, batch_size, gen)
        booted.graphs.replay(batch, batch_size)  # the batch into the graph's static inputs
        graph_us = median_us(booted.graphs.graphs[batch_size].replay, reps=20)
        bytes_ = roofline_bytes(model, batch_size, touched_experts(model, batch), CONTEXT)
        roofline_us = bytes_["total"] / bandwidth * 1e6
        head = head_us(model, batch_size)
        per_layer = (graph_us - head) / args.layers
        full_ms = (per_layer * FULL_DEPTH + head) / 1e3
        results["batches"][batch_size] = {"graph_us": graph_us, "roofline_us": roofline_us, "bytes": bytes_,
                                          "head_us": head, "per_layer_us": per_layer,
                                          "extrapolated_step_ms": full_ms}  # fmt: skip
        results[f"deep_roofline_fraction_b{batch_size}"] = roofline_us / graph_us
        mb = " / ".join(f"{bytes_[k] / 1e6:.0f}" for k in ("dense_weights", "routed_experts", "kv_rows"))
        lines.append(f"| {batch_size} | {graph_us:.0f} | {roofline_us:.0f} | {roofline_us / graph_us:.2f} | "
                     f"{head:.0f} | {per_layer:.0f} | {full_ms:.2f} | {mb} |")  # fmt: skip
        print(lines[-1], flush=True)
        if batch_size == 1:
            try:  # the profile explains the step; a profiler that sees no graph kernels leaves it out
                profile_rows = kernel_profile(booted.graphs.graphs[batch_size].replay)
            except Exception as error:  # noqa: BLE001 -- reported, the run's figures kept
                print(f"no kernel profile: {error!r}", flush=True)
                profile_rows = []
            results["profile_b1"] = profile_rows
        for state in states:
            alone.release_state(state)
    results["extrapolated_tpot_ms_c1"] = results["batches"][1]["extrapolated_step_ms"]
    prefill = prefill_seconds(alone, gen)
    results["prefill_seconds_8k"], results["prefill_tok_s_8k"] = prefill, PREFILL / prefill
    results.update(provenance())
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "deep.json").write_text(json.dumps(results, indent=2) + "\n")
    head_lines = [
        f"# The deepest V4-Flash-width model on one {gpu} — {results['date']}, commit {results['commit']}",
        "",
        f"torch {torch.__version__}, triton {triton.__version__}. Command: `python bench/deep.py --out bench/results "
        f"--layers {args.layers}`.",
        "",
        f"- {args.layers} of {FULL_DEPTH} layers (compress ratios {model.args.compress_ratios}; the first "
        f"{model.args.num_hash_layers} hash-routed), 256 experts each in MXFP4, dense linears FP8, FP8 KV, "
        f"`--load-format dummy`, gpu_memory_utilization {args.gpu_memory_utilization}",
        f"- boot {boot_seconds:.1f} s; weights {weights / 1e9:.2f} GB = "
        f"{results['weights_bytes_ratio']:.3f} of the model's tensor bytes",
        f"- KV pool {capacity} tokens = {capacity / MAX_CONTEXT:.2f} requests of 1M tokens",
        f"- decode from CUDA graphs, each request at {CONTEXT} tokens, copy bandwidth {bandwidth / 1e12:.2f} TB/s; "
        f"43-layer step extrapolated at batch 1: {results['extrapolated_tpot_ms_c1']:.2f} ms",
        f"- prefill of an {PREFILL}-token prompt in one step: {prefill:.2f} s = {PREFILL / prefill:.0f} tok/s",
        "",
    ]
    profile_rows = results.get("profile_b1", [])
    if profile_rows:
        total = sum(row["us_per_step"] for row in profile_rows)
        lines += ["", f"Where a batch-1 step's GPU time goes (torch.profiler over graph replays; {total:.0f} µs of "
                  f"kernels a step, {total / args.layers:.0f} µs a layer):", "",
                  "| kernel | µs a step | share | calls a step | µs a call |", "|---|---|---|---|---|"]  # fmt: skip
        for row in profile_rows[:30]:
            us, calls = row["us_per_step"], row["calls_per_step"]
            lines.append(f"| {row['kernel'][:70]} | {us:.0f} | {us / total:.1%} | {calls:.0f} | {us / calls:.1f} |")
    (args.out / "deep.md").write_text("\n".join(head_lines + lines) + "\n")
    (args.out / "deep.svg").write_text(chart(results))
    print("\n".join(head_lines + lines))


if __name__ == "__main__":
    main()
