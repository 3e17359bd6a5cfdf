"""The serving report, on an H200, in one run: `python -m engine serve` with a V4-Flash-width model of reduced depth
(bench/shapes.py; seeded random bf16 weights made on the GPU, never on disk) driven by bench/serve.py's streaming
client, for two profiles that differ only in `context_length` (8K and 1M):

- decode tok/s at concurrency 1, 16 and 64, 512-token prompts: concurrency over the median gap between a stream's
  tokens while every stream decodes (from the last stream's first token to the first stream's last: every prompt
  prefilled, none finished), the 1M / 8K ratio at 64 being the field report's test (64 vs 532 tok/s there);
- the served decode step (that median gap) against the step's bandwidth roofline: bench/step.py's byte model, with
  per MoE layer the mean distinct experts a decode step of the load read (the engine counts them on the device:
  /metrics' flashgate_moe_experts_touched_total over flashgate_steps_total), over the copy bandwidth measured here;
- decode tok/s at concurrency 16 with 128K-token prompts on the 1M profile, measured the same way, and their TTFT,
  within what is left of a 9-minute run (RUN_BUDGET_S; else null with the reason);
- KV capacity reported against the budget (gpu_memory_utilization x total - weights - graph reserve - workspace)
  over the architecture's bytes per token;
- the boot stages, and the kernel variants made after boot (each delays the first request that needs it);
- as a sanity check measured the same way (512-token prompt + 32 new tokens, tokens / wall time including prefill),
  transformers on the same config in its own process (`--transformers`).

    python bench/serve_report.py --out bench/results     # writes serve.json and serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.kernels import copy_bandwidth  # noqa: E402
from bench.plots import draw  # noqa: E402
from bench.provenance import provenance  # noqa: E402
from bench.serve import Engine, parse_metrics, run  # noqa: E402
from bench.shapes import COMPRESS_RATIOS, write_model_dir  # noqa: E402
from bench.step import roofline_bytes  # noqa: E402
from engine.cache.layout import KVLayout  # noqa: E402
from engine.model.args import ModelArgs  # noqa: E402
from engine.model.deepseek_v4 import DeepseekV4  # noqa: E402

PROFILES = {"8K": 8192, "1M": 1048576}
CONCURRENCY = (1, 16, 64)
PROMPT, OUTPUT, SANITY_OUTPUT = 512, 64, 32
UTILIZATION = 0.90
BATCHED_TOKENS = 4096
ENGINE_FLAGS = ["--load-format", "dummy", "--dtype", "bfloat16", "--max-num-seqs", "64", "--cuda-graph-max-bs", "64",
                "--max-num-batched-tokens", str(BATCHED_TOKENS),
                "--gpu-memory-utilization", str(UTILIZATION)]  # fmt: skip
# 128K prompts at concurrency 16 on the 1M profile. The prompts prefill one after another, a step's token budget at a
# time (less the decode rows of those already done), so each stream's output outlasts the later prompts' prefill by
# 64 tokens: then all 16 decode together.
LONG_PROMPT, LONG_CONCURRENCY = 131072, 16
LONG_OUTPUT = LONG_CONCURRENCY * (LONG_PROMPT // (BATCHED_TOKENS - LONG_CONCURRENCY) + 1) + 64
# Seconds: the whole run stays within 9 minutes (the device's commands get 10). The 128K phase gets what is left after
# the rest, less AFTER_LONG_S for what follows it (the engine's shutdown, the transformers run); under LONG_MIN_S it
# does not start.
RUN_BUDGET_S, AFTER_LONG_S, LONG_MIN_S = 540, 120, 30


def all_decoding_gaps(requests: list[dict]) -> list[float]:
    """Gaps between a stream's tokens while every stream decodes: after the last stream's first token (every prompt
    prefilled) and up to the first stream's last (none finished), each step runs one decode row per stream and
    nothing else. Token times are each request's start, TTFT and gaps, on the load's clock; none if one failed."""
    if any(r["error"] or r["ttft_s"] is None for r in requests):
        return []
    times = [list(itertools.accumulate(r["chunk_gaps_s"], initial=r["started_s"] + r["ttft_s"])) for r in requests]
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    return [b - a for t in times for a, b in itertools.pairwise(t) if a >= start and b <= end]


def load(url: str, concurrency: int, input_len: int, output_len: int, deadline_s: float | None = None) -> dict:
    """One request per stream; raises TimeoutError past deadline_s (its requests are dropped, which frees them in the
    engine). A stream's mean TPOT also holds the steps in which later requests' prompts were prefilled, hence the
    median gap while every stream decodes."""
    args = argparse.Namespace(num_prompts=concurrency, concurrency=concurrency, input_len=input_len,
                              output_len=output_len, seed=concurrency, smoke=False)  # fmt: skip
    report = asyncio.run(asyncio.wait_for(run(url, args), deadline_s))
    gaps = all_decoding_gaps(report["requests"])
    step_s = statistics.median(gaps) if gaps else None
    return {"summary": report["summary"], "decode_step_s": step_s, "decode_tok_s": step_s and concurrency / step_s,
            "all_decoding_gaps": len(gaps), "info": report["engine"]}  # fmt: skip


def long_context(url: str, deadline_s: float) -> dict:
    """LONG_CONCURRENCY requests of LONG_PROMPT tokens at once, within deadline_s; decode_tok_s null with an error
    otherwise."""
    phase = {"prompt_tokens": LONG_PROMPT, "output_tokens": LONG_OUTPUT, "concurrency": LONG_CONCURRENCY,
             "deadline_s": round(deadline_s), "decode_tok_s": None}  # fmt: skip
    if deadline_s < LONG_MIN_S:
        return phase | {"error": f"not run: {deadline_s:.0f} s left of the run's {RUN_BUDGET_S} s"}
    before = parse_metrics(httpx.get(f"{url}/metrics").text)
    try:
        measured = load(url, LONG_CONCURRENCY, LONG_PROMPT, LONG_OUTPUT, deadline_s)
    except TimeoutError:
        after = parse_metrics(httpx.get(f"{url}/metrics").text)
        prefilled = int(after["flashgate_prompt_tokens_total"] - before["flashgate_prompt_tokens_total"]) // LONG_PROMPT
        return phase | {"error": f"the {deadline_s:.0f} s deadline passed with {prefilled} of {LONG_CONCURRENCY} "
                                 f"prompts prefilled"}  # fmt: skip
    measured.pop("info")
    if measured["decode_tok_s"] is None:
        summary = measured["summary"]
        measured["error"] = (f"no step in which every stream decoded ({summary['failed']} failed: "
                             f"{summary['errors']})")  # fmt: skip
    return phase | measured


def engine_log(log_path: Path) -> list[dict]:
    """The engine's JSON log events (stderr)."""
    return [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]


def boot_facts(events: list[dict]) -> dict:
    """Seconds per boot stage (graph_capture includes the eager shapes' warm-up, also given alone), and the kernel
    variants made after boot (each delays the first request that needs it)."""
    stages = {e["stage"]: e for e in events if e["event"] == "boot_stage"}
    late = [{k: e[k] for k in ("kernel", "num_warps", "num_stages", "constants", "aligned") if k in e}
            for e in events if e["event"] == "kernel_compiled_after_boot"]  # fmt: skip
    return {"boot_seconds": {name: stage["seconds"] for name, stage in stages.items()},
            "warmup_seconds": stages.get("graph_capture", {}).get("warmup_seconds"),
            "kernels_compiled_after_boot": late}  # fmt: skip


def kv_capacity_efficiency(info: dict, kv_alloc: dict, layout: KVLayout) -> float:
    memory = info["gpu_memory"]
    budget = UTILIZATION * memory["total_bytes"] - memory["weights_bytes"]
    budget -= kv_alloc["graph_reserve_bytes"] + kv_alloc["workspace_bytes"]
    return info["kv_capacity_tokens"] / (budget / layout.bytes_per_token)


def transformers_tok_s(model_dir: Path) -> dict:
    """In this process: transformers' DeepseekV4ForCausalLM on the same config, random bf16 weights on the GPU."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(model_dir)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    prompt = torch.randint(2, config.vocab_size, (1, PROMPT), device="cuda")
    generate = dict(max_new_tokens=SANITY_OUTPUT, min_new_tokens=SANITY_OUTPUT, do_sample=False)
    model.generate(prompt[:, :16], max_new_tokens=2)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(prompt, **generate)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    new = out.shape[1] - PROMPT
    return {"transformers": transformers.__version__, "new_tokens": new, "seconds": seconds, "tok_s": new / seconds}


def main() -> None:
    run_started = time.monotonic()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--transformers", action="store_true", help="only the transformers run; prints JSON")
    args = parser.parse_args()
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / "v4-flash-width")
    if args.transformers:
        print(json.dumps(transformers_tok_s(model_dir)))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    bandwidth = copy_bandwidth()
    torch.cuda.empty_cache()
    model_args = ModelArgs.from_model_dir(model_dir)
    with torch.device("meta"):
        meta_model = DeepseekV4(model_args).cast(torch.bfloat16)
    layout = KVLayout.for_model(model_args, 256, "fp8_e4m3")
    results: dict = {"gpu": gpu, "copy_bandwidth_tb_s": bandwidth / 1e12, "profiles": {}, "decode_tok_s": {}}
    lines = [f"GPU: {gpu}; copy {bandwidth / 1e12:.2f} TB/s. Model: V4-Flash widths, layers {COMPRESS_RATIOS}, "
             f"256 experts, bf16 weights (dummy), FP8 KV. Engine flags: `{' '.join(ENGINE_FLAGS)}`.", "",
             "| profile | concurrency | decode tok/s | decode step ms (median token gap, all streams decoding) "
             "| TPOT p50 ms | TTFT p50 ms "
             "| experts per MoE layer (decode step mean) | step roofline ms | roofline fraction |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for name, context_length in PROFILES.items():
        log_path = args.out / f"serve-engine-{name}.log"
        engine = Engine(str(model_dir), [*ENGINE_FLAGS, "--context-length", str(context_length)], log_path)
        try:
            profile: dict = {"load": {}}
            for concurrency in CONCURRENCY:
                measured = load(engine.url, concurrency, PROMPT, OUTPUT)
                step, summary = measured["decode_step_s"], measured["summary"]
                touched = summary["decode_experts_touched"]
                if step is None or touched is None:
                    raise RuntimeError(f"{name} c{concurrency}: no decode step measured or counted: {summary}")
                roofline_s = roofline_bytes(meta_model, concurrency, touched, PROMPT + OUTPUT // 2)["total"] / bandwidth
                measured["roofline_fraction"] = roofline_s / step
                profile["load"][concurrency] = measured
                results["decode_tok_s"][f"{name}_c{concurrency}"] = measured["decode_tok_s"]
                lines.append(f"| {name} | {concurrency} | {measured['decode_tok_s']:.0f} | {step * 1e3:.2f} | "
                             f"{summary['tpot_s']['p50'] * 1e3:.2f} | {summary['ttft_s']['p50'] * 1e3:.0f} | "
                             f"{[round(t, 1) for t in touched]} | {roofline_s * 1e3:.3f} | "
                             f"{roofline_s / step:.2f} |")  # fmt: skip
                print(lines[-1], flush=True)
            info = profile["load"][CONCURRENCY[0]].pop("info")
            for measured in profile["load"].values():
                measured.pop("info", None)
            profile["kv_capacity_tokens"] = info["kv_capacity_tokens"]
            kv_alloc = next(e for e in engine_log(log_path) if e.get("stage") == "kv_alloc")
            profile["kv_capacity_efficiency"] = kv_capacity_efficiency(info, kv_alloc, layout)
            profile["gpu_memory"] = info["gpu_memory"]
            if name == "8K":
                sanity = load(engine.url, 1, PROMPT, SANITY_OUTPUT)["summary"]
                profile["sanity_tok_s"] = SANITY_OUTPUT / sanity["duration_s"]
            if name == "1M":
                deadline_s = RUN_BUDGET_S - AFTER_LONG_S - (time.monotonic() - run_started)
                profile["long_context"] = long_context(engine.url, deadline_s)
                print("128K phase:", {k: v for k, v in profile["long_context"].items() if k != "summary"}, flush=True)
        finally:
            engine.stop()
        profile |= boot_facts(engine_log(log_path))
        results["profiles"][name] = profile
        (args.out / "serve.json").write_text(json.dumps(results, indent=2) + "\n")  # partial results survive
    done = subprocess.run([sys.executable, __file__, "--out", str(args.out), "--transformers"], capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    if done.returncode == 0:
        results["transformers_baseline"] = json.loads(done.stdout.strip().splitlines()[-1])
        ours = results["profiles"]["8K"]["sanity_tok_s"]
        results["speedup_vs_transformers_c1"] = ours / results["transformers_baseline"]["tok_s"]
    else:
        results["transformers_baseline"] = {"error": done.stderr[-2000:]}
    eight, one_m = results["profiles"]["8K"]["load"], results["profiles"]["1M"]["load"]
    results["context_length_ratio_c64"] = one_m[64]["decode_tok_s"] / eight[64]["decode_tok_s"]
    results["roofline_fraction_c1"] = eight[1]["roofline_fraction"]
    results["roofline_fraction_c16"] = eight[16]["roofline_fraction"]
    results["kv_capacity_efficiency"] = min(p["kv_capacity_efficiency"] for p in results["profiles"].values())
    long = results["profiles"]["1M"]["long_context"]
    results["decode_tok_s_128k_c16"] = long["decode_tok_s"]  # null: long["error"] says why
    results.update(provenance())
    (args.out / "serve.json").write_text(json.dumps(results, indent=2) + "\n")
    baseline = results["transformers_baseline"]
    long_line = (
        f"decode **{long['decode_tok_s']:.0f} tok/s** (step {long['decode_step_s'] * 1e3:.2f} ms), TTFT p50 "
        f"{long['summary']['ttft_s']['p50']:.1f} s, p99 {long['summary']['ttft_s']['p99']:.1f} s."
        if long["decode_tok_s"]
        else f"**null**: {long['error']}."
    )
    boot = "; ".join(
        f"{n}: "
        + ", ".join(f"{stage} {seconds} s" for stage, seconds in p["boot_seconds"].items())
        + f" (warm-up {p['warmup_seconds']} s), {len(p['kernels_compiled_after_boot'])} kernels made after boot"
        for n, p in results["profiles"].items()
    )
    lines += [
        "",
        f"1M / 8K decode throughput at concurrency 64: **{results['context_length_ratio_c64']:.3f}** (target ≥ 0.95; "
        "field report (a): 0.12).",
        f"KV capacity efficiency (reported ÷ budget over bytes per token): {results['kv_capacity_efficiency']:.3f} "
        "(target ≥ 0.95).",
        f"Sanity, 512-token prompt + {SANITY_OUTPUT} new tokens at concurrency 1, tokens ÷ wall time with prefill: "
        f"ours {results['profiles']['8K']['sanity_tok_s']:.1f} tok/s; transformers "
        + (f"{baseline['transformers']} {baseline['tok_s']:.1f} tok/s → ×{results['speedup_vs_transformers_c1']:.1f}"
           if "tok_s" in baseline else "failed (see serve.json)"),
        f"128K prompts ({LONG_PROMPT} tokens) at concurrency {LONG_CONCURRENCY} on the 1M profile, {LONG_OUTPUT} new "
        f"tokens each (so that all streams decode together after the last prefill): {long_line}",
        "",
        "Roofline: bench/step.py's bytes (dense weights, each routed expert read, the KV rows attended at "
        f"{PROMPT + OUTPUT // 2} tokens) over the copy bandwidth, with per MoE layer the mean distinct experts a "
        "decode step of that load read, counted by the engine on the device. Ramp-up and ramp-down steps with fewer "
        "streams are in that mean, which makes the roofline and the fraction a bit lower (conservative); a CUDA "
        "graph's padding rows count (their experts are read).",
        "Boot stages (the seconds of `ready` count from the start; graph_capture includes the warm-up of the eager "
        "shapes) and kernel variants made after boot (each delays the first request that needs it; names in "
        f"serve.json, full lines in the engine logs): {boot}.",
    ]  # fmt: skip
    header = [f"# Serving — {results['date']}, {gpu}, commit {results['commit']}",
              "Command: `python bench/serve_report.py --out DIR` (engine logs beside the results).", "",
              "![decode tok/s of the 8K and 1M profiles at concurrency 1, 16, 64](serve.svg)", ""]  # fmt: skip
    (args.out / "serve.md").write_text("\n".join(header + lines) + "\n")
    draw(args.out, only="serve.json")
    print("\n".join(lines[-8:]))


if __name__ == "__main__":
    main()
