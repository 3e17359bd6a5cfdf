"""One full decode step of a V4-Flash-width model of reduced depth (bench/shapes.py: real widths, one layer of each
kind, all 256 experts, lm_head included, seeded random bf16 weights made on the GPU) at batch 1, 16 and 64, replayed
from the serving runtime's CUDA graphs, against its bandwidth roofline: the bytes a step must read once — dense
weights, each routed expert the batch touches, only the KV rows attended (FP8) — over the copy bandwidth measured in
the same run. Also: the same step run eagerly, kernels launched per step, the graph's logits against eager ones, and
the share of the step's GPU time spent in sparse attention (its kernel and the split merge), which bounds what a faster
attention kernel can give the step.

    python bench/step.py --out bench/results     # writes step.json and step.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth, median_us  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from bench.shapes import COMPRESS_RATIOS, write_model_dir  # noqa: E402
from engine.cache.layout import KVLayout  # noqa: E402
from engine.cuda_graphs import DecodeGraphs  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.state import ForwardBatch  # noqa: E402
from engine.standalone import Standalone  # noqa: E402

DEV = torch.device("cuda")
BATCHES = (1, 16, 64)
CONTEXT = 4096  # tokens each request already holds in the cache
MAX_CONTEXT = 131072  # the page tables (and the graphs) are sized for this
MAIN_ROW_BYTES, INDEX_ROW_BYTES = 584, 132  # FP8 rows (engine/cache/kv_cache.py)


def kv_bytes_per_request(model, context: int) -> int:
    """KV rows one query reads: its window, and per c4 layer the top-k rows plus every index key; per c128 layer
    every compressed row."""
    args, total = model.args, 0
    for ratio in args.compress_ratios[: args.num_hidden_layers]:
        total += min(context + 1, args.sliding_window) * MAIN_ROW_BYTES
        visible = (context + 1) // ratio if ratio else 0
        if ratio == 4:
            total += min(visible, args.index_topk) * MAIN_ROW_BYTES + visible * INDEX_ROW_BYTES
        elif ratio:
            total += visible * MAIN_ROW_BYTES
    return total


def decode_batch(alone: Standalone, batch_size: int, gen: torch.Generator) -> tuple[list, ForwardBatch]:
    """`batch_size` new requests, each at CONTEXT tokens, decoding one random token, with their tables."""
    states = [alone.new_state() for _ in range(batch_size)]
    for state in states:
        state.num_tokens = CONTEXT  # the rows' contents do not change the step's work
    ids = torch.randint(0, alone.args.vocab_size, (batch_size,), generator=gen, device=DEV)
    batch = ForwardBatch(ids, torch.full((batch_size,), CONTEXT, device=DEV), states, [1] * batch_size)
    alone.prepare(batch)
    return states, batch


def touched_experts(model, batch) -> list[int]:
    """Distinct routed experts each layer's MoE picks for this batch (one eager step, hooks on the gates)."""
    counts: list[int] = []
    hooks = [layer.ffn.gate.register_forward_hook(lambda _m, _i, out: counts.append(int(out[1].unique().numel())))
             for layer in model.layers]  # fmt: skip
    model.logits(model.run_layers(batch))
    for hook in hooks:
        hook.remove()
    return counts


def roofline_bytes(model, batch_size: int, touched: list[int], context: int) -> dict[str, int]:
    params = dict(model.named_parameters())
    dense = sum(
        p.numel() * p.element_size() for n, p in params.items() if ".experts.w" not in n and n != "embed.weight"
    )
    dense += batch_size * model.args.hidden_size * params["embed.weight"].element_size()  # the embedding rows read
    # One expert's bytes in every tensor of its format (codes and scales when quantized).
    expert = sum(p[0].numel() * p.element_size() for n, p in params.items() if n.startswith("layers.0.ffn.experts."))
    experts = sum(touched) * expert
    kv = batch_size * kv_bytes_per_request(model, context)
    return {"dense_weights": dense, "routed_experts": experts, "kv_rows": kv, "total": dense + experts + kv}


ATTENTION_KERNELS = ("_sparse_attention_kernel", "_merge_splits_kernel")  # engine/kernels/sparse_attention.py


def kernel_profile(model, batch) -> tuple[int, float, float, str]:
    """Kernels one eager step launches, their GPU µs, the µs of those in ATTENTION_KERNELS, and a table of where the
    step's GPU time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        model.logits(model.run_layers(batch))
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.time_range.elapsed_us() for e in kernels)
    attention_us = sum(e.time_range.elapsed_us() for e in kernels if e.name in ATTENTION_KERNELS)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
    return len(kernels), total_us, attention_us, table


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--weights", choices=("bf16", "official"), default="bf16",
                        help="official: FP8 dense linears and MXFP4 experts as the official checkpoint stores them "
                        "(results in step-official.*)")  # fmt: skip
    args = parser.parse_args()
    official = args.weights == "official"
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    before = torch.cuda.memory_allocated()
    model = load_model(write_model_dir(Path(tempfile.mkdtemp()), official), torch.bfloat16, DEV, load_format="dummy")
    held = torch.cuda.memory_allocated() - before
    tensor_bytes = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    layout = KVLayout.for_model(model.args, 256, "fp8_e4m3")
    alone = Standalone.allocate(model, max(BATCHES) * layout.pages_for(CONTEXT + 1) + 1, max(BATCHES) + 1, "fp8_e4m3")
    cache = alone.kv_cache
    graphs = DecodeGraphs(model, max(BATCHES), layout.pages_for(MAX_CONTEXT), pad_slot=alone.blocks.take_slot())
    gen = torch.Generator(device=DEV).manual_seed(0)
    results: dict = {"gpu": gpu, "copy_bandwidth_tb_s": bandwidth / 1e12, "batches": {}, "weights_bytes": held,
                     "weights_bytes_ratio": held / tensor_bytes}  # fmt: skip
    lines = [
        f"GPU: {gpu}; copy {bandwidth / 1e12:.2f} TB/s. Model: V4-Flash widths, layers {COMPRESS_RATIOS} "
        f"(compress ratio per layer; the first {model.args.num_hash_layers} hash-routed), 256 experts, "
        f"{'FP8 dense linears and MXFP4 experts' if official else 'bf16 weights'}, "
        f"FP8 KV; each request at {CONTEXT} tokens, page tables (and graphs) sized for {MAX_CONTEXT}. Weights on "
        f"the GPU after loading: {held / 1e9:.2f} GB, {held / tensor_bytes:.3f} of the model's tensor bytes.",
        "",
        "| batch | graph µs/step | eager µs/step | roofline µs | fraction | experts touched per layer | bytes: dense / "
        "experts / KV (MB) | graph vs eager logits max abs diff | sparse attention µs/step (share of GPU time) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for batch_size in BATCHES:
        states, batch = decode_batch(alone, batch_size, gen)
        saved = [t.clone() for t in cache.tensors()]  # both runs of the step start from the same cache
        graph_logits = graphs.replay(batch, batch_size).clone()  # also leaves the batch in the graph's static inputs
        for tensor, before in zip(cache.tensors(), saved, strict=True):
            tensor.copy_(before)
        eager_logits = model.logits(model.run_layers(batch))
        del saved
        graph_us = median_us(graphs.graphs[batch_size].replay, reps=30)
        eager_us = median_us(lambda batch=batch: model.logits(model.run_layers(batch)), reps=10, warmup=2)
        touched = touched_experts(model, batch)
        bytes_ = roofline_bytes(model, batch_size, touched, CONTEXT)
        roofline_us = bytes_["total"] / bandwidth * 1e6
        diff = float((graph_logits - eager_logits).abs().max())
        kernels, kernel_us, attention_us, breakdown = kernel_profile(model, batch)
        results["batches"][batch_size] = {
            "graph_us": graph_us,
            "eager_us": eager_us,
            "roofline_us": roofline_us,
            "experts_touched": touched,
            "bytes": bytes_,
            "logits_max_abs_diff": diff,
            "kernels": kernels,
            "kernel_us": kernel_us,
            "sparse_attention_us": attention_us,
            "sparse_attention_share": attention_us / kernel_us,
        }
        results[f"roofline_fraction_b{batch_size}"] = roofline_us / graph_us
        mb = " / ".join(f"{bytes_[k] / 1e6:.0f}" for k in ("dense_weights", "routed_experts", "kv_rows"))
        lines.append(f"| {batch_size} | {graph_us:.0f} | {eager_us:.0f} | {roofline_us:.0f} | "
                     f"{roofline_us / graph_us:.2f} | {touched} | {mb} | {diff:.2e} | {attention_us:.0f} "
                     f"({attention_us / kernel_us:.1%}) |")  # fmt: skip
        print(lines[-1], flush=True)
        if batch_size == 1:
            results["kernels_per_step"], batch1_breakdown = kernels, breakdown
        for state in states:
            alone.release_state(state)
    lines += [
        "",
        f"Kernels launched per step (batch 1, eager, profiler): {results['kernels_per_step']}.",
        "Targets (issue 5): whole step at batch 1 and 16 ≥ 0.5 of the roofline.",
        "",
        "Sparse attention's share: its kernels' time over all kernels' time in one eager step (torch.profiler); the "
        "kernels are the ones a graph replays.",
        "",
        "Where an eager step's GPU time goes at batch 1 (torch.profiler):",
        "",
        "```",
        batch1_breakdown,
        "```",
    ]
    results.update(provenance())
    args.out.mkdir(parents=True, exist_ok=True)
    name = "step-official" if official else "step"
    (args.out / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    header = [
        f"# Whole decode step — {results['date']}, {gpu}, commit {results['commit']}",
        f"torch {torch.__version__}, triton {triton.__version__}. Command: `python bench/step.py --out DIR"
        + (" --weights official`." if official else "`."),
        "",
    ]
    (args.out / f"{name}.md").write_text("\n".join(header + lines) + "\n")
    print("\n".join(lines[-(10 + batch1_breakdown.count("\n")) :]))


if __name__ == "__main__":
    main()
