"""`python bench/demo_train.py [--steps N] [--replicas 1,2,4] [--row-tokens 4096,16384] [--mps] [--out DIR] …`:
where a demo-model training step's time goes (issue 31). A session's device minutes bound the demo model's tokens
(run 6: 25.7M, about 3 a parameter, still undertrained), so this measures train_demo's own step (`train_step`) on
its own packed rows, with the c4 layers dense (the warm-up) and sparse, and sparse again on the plain references
alone (without the kernels written with a backward): seconds and tokens a step, tok/s, and from one
profiled step the device's busy share (its kernels' time over the step's wall time: a small share means the host,
launching, is the limit), the kernels launched and the ops that take the most device and host time. Then whole
training runs (`train`, sparse) in 1, 2, 4 … replicas (`Replicas`: processes sharing the GPU, each launching its
share of a step's rows) and rows of each length (`Recipe.row_tokens`): tok/s after the first steps, its ratio to one
replica's, the peak memory. Without MPS a GPU runs one process's kernels at a time, switching between them; `--mps`
also times the runs of more than one replica under NVIDIA's Multi-Process Service (the control daemon started here,
its pipes in a temporary folder, and quit after), whose replicas' kernels run side by side. Results:
DIR/demo-train.json and .md, with GPU, commit and date. `--smoke`: the tiny model on a few hundred tokens, on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

# torch.cuda.is_available() through NVML, which leaves CUDA uninitialised: replicas are forked after it.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.provenance import provenance  # noqa: E402
from engine.tools import demo_data  # noqa: E402
from engine.tools.make_tiny import TINY_CONFIG  # noqa: E402
from engine.tools.train_demo import (  # noqa: E402
    Recipe,
    batches,
    differentiable_kernels,
    examples,
    initial_model,
    optimizer_for,
    train,
    train_step,
)

RESULTS = Path(__file__).resolve().parent / "results"
WARMUP_STEPS = 2
TOP_OPS = 12


def measure(recipe: Recipe, device: torch.device, steps: int, samples: int) -> dict:
    """The phases' timings, inside differentiable_kernels() (which restores FLASHGATE_KERNELS after)."""
    torch.backends.cuda.matmul.allow_tf32 = True  # as train_demo trains
    tokenizer = demo_data.default_tokenizer()
    config = demo_data.Config(seed=recipe.seed, max_tokens=recipe.max_tokens)
    items = examples(demo_data.generate("train", demo_data.mix_counts(samples), config, tokenizer))
    model = initial_model(recipe, device)
    optimizer = optimizer_for(model, recipe)
    rows_of = batches(items, recipe.tokens_per_step, recipe.row_tokens, recipe.seed)
    phases = {}
    # The last phase again on the plain references alone (FLASHGATE_KERNELS=torch): what the kernels written with a
    # backward (mHC's Sinkhorn) save a step, in the same run.
    for phase, step, kernels in (("dense", 0, "autograd"), ("sparse", recipe.dense_warmup_steps, "autograd"),
                                 ("sparse, references only", recipe.dense_warmup_steps, "torch")):  # fmt: skip
        os.environ["FLASHGATE_KERNELS"] = kernels
        for _ in range(WARMUP_STEPS):
            train_step(model, optimizer, next(rows_of), recipe, step, device)
        timed = [next(rows_of) for _ in range(steps)]
        _sync(device)
        started = time.perf_counter()
        for rows in timed:
            train_step(model, optimizer, rows, recipe, step, device)
        _sync(device)
        seconds = (time.perf_counter() - started) / steps
        tokens = sum(len(e.ids) for rows in timed for row in rows for e in row) / steps
        phases[phase] = {"s_per_step": round(seconds, 4), "tokens_per_step": round(tokens),
                         "rows_per_step": round(sum(len(rows) for rows in timed) / steps, 1),
                         "tok_s": round(tokens / seconds), **profiled(model, optimizer, next(rows_of), recipe, step,
                                                                      device),
                         "device_waits": device_waits(model, optimizer, next(rows_of), recipe, step,
                                                      device)}  # fmt: skip
    return phases


def scaling(recipe: Recipe, device: torch.device, counts: list[int], row_lengths: list[int], steps: int,
            samples: int, held_out: Path, mps: bool) -> tuple[list[dict], str | None]:  # fmt: skip
    """tok/s of whole training runs in each number of replicas and at each row length (and with `mps` those of more
    than one replica again under MPS), over the steps after the first WARMUP_STEPS (the start's sample drawing and
    compiling left out), its ratio to one replica's at `recipe`'s row length, and the first replica's peak memory;
    and why MPS was not measured, if it was asked for and not."""
    run = dataclasses.replace(recipe, train_samples=samples, steps=WARMUP_STEPS + steps, warmup_steps=1,
                              dense_warmup_steps=0)  # fmt: skip
    runs: dict[tuple[int, int, bool], dict] = {}
    several = sorted((n for n in counts if n > 1), reverse=True)
    with tempfile.TemporaryDirectory() as work:

        def timed(count: int, under_mps: bool) -> None:
            for row_tokens in row_lengths:
                out = Path(work) / f"{count}-{row_tokens}-{under_mps}"
                train(dataclasses.replace(run, row_tokens=row_tokens), out, device, held_out, replicas=count)
                written = json.loads((out / "train_log.json").read_text())
                first, last = written["curve"][WARMUP_STEPS - 1], written["curve"][-1]
                seconds = last["tokens"] / last["tok_s"] - first["tokens"] / first["tok_s"]
                runs[count, row_tokens, under_mps] = {"rate": (last["tokens"] - first["tokens"]) / seconds,
                                                      "peak": written["peak_memory_bytes"]}  # fmt: skip

        missing = None
        if mps:
            with mps_daemon(Path(work) / "mps") as missing:
                try:
                    for count in several if missing is None else []:
                        timed(count, True)
                except RuntimeError as error:  # a replica that could not use MPS: the runs without it still count
                    missing = f"a run under MPS failed: {error}"
                    for key in [key for key in runs if key[2]]:
                        del runs[key]
        # One replica trains in this process, touching its GPU, after which no replica could be forked: it goes last.
        for count in several + ([1] if 1 in counts else []):
            timed(count, False)
    one = runs.get((1, recipe.row_tokens, False), {}).get("rate")
    return [{"replicas": n, "row_tokens": r, "mps": m, "tok_s": round(got["rate"]),
             "vs_one": round(got["rate"] / one, 2) if one else None,
             "peak_memory_gb": got["peak"] and round(got["peak"] / 1e9, 1)}
            for (n, r, m), got in sorted(runs.items())], missing  # fmt: skip


@contextlib.contextmanager
def mps_daemon(folder: Path) -> Iterator[str | None]:
    """NVIDIA's MPS control daemon, its pipe and log folders under `folder`, while active (the replicas forked meanwhile
    inherit the folders' variables and become its clients); yields None, or why it could not be started."""
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        yield "nvidia-cuda-mps-control is not installed"
        return
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(folder / "pipe"), "CUDA_MPS_LOG_DIRECTORY": str(folder / "log")}
    for path in env.values():
        Path(path).mkdir(parents=True, exist_ok=True)
    started = subprocess.run([control, "-d"], env=os.environ | env, stdin=subprocess.DEVNULL, capture_output=True,
                             text=True, timeout=30)  # fmt: skip
    if started.returncode != 0:
        yield f"nvidia-cuda-mps-control -d failed ({started.returncode}): {(started.stderr or started.stdout).strip()}"
        return
    os.environ.update(env)
    try:
        yield None
    finally:
        subprocess.run([control], input="quit\n", env=os.environ.copy(), capture_output=True, text=True, timeout=60)
        for name in env:
            del os.environ[name]


def profiled(model, optimizer, rows, recipe: Recipe, step: int, device: torch.device) -> dict:
    """One step under torch.profiler: the device's busy share, the kernels launched, the top ops by device and host
    time (self time, ms)."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        train_step(model, optimizer, rows, recipe, step, device)
        _sync(device)
    wall = time.perf_counter() - started
    events = prof.key_averages()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    device_s = sum(e.self_device_time_total for e in events) / 1e6 if cuda else None

    def by(attr: str) -> list[dict]:
        top = sorted(events, key=lambda e: getattr(e, attr), reverse=True)[:TOP_OPS]
        return [{"op": e.key, "ms": round(getattr(e, attr) / 1e3, 2), "calls": e.count} for e in top]

    return {
        "profiled_wall_s": round(wall, 4),
        "device_busy_share": round(device_s / wall, 3) if cuda else None,
        "kernels_launched": len(kernels) if cuda else None,
        "host_ops": sum(e.count for e in events),
        "top_device_ops": by("self_device_time_total") if cuda else [],
        "top_host_ops": by("self_cpu_time_total"),
    }


def device_waits(model, optimizer, rows, recipe: Recipe, step: int, device: torch.device) -> dict | None:
    """One step's calls that wait for the GPU (CUDA's sync debug mode warns at each: a read to the host, a copy from
    pageable memory): how many, and the most frequent places (file:line of the call). None on the CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train_step(model, optimizer, rows, recipe, step, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    places = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {"count": sum(places.values()), "places": dict(places.most_common(TOP_OPS))}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def markdown(result: dict) -> str:
    lines = [
        "# Demo-model training step: where the time goes (issue 31)",
        "",
        f"{result['device']}, commit {result['commit']}, {result['date']}, torch {result['torch']}. "
        "`python bench/demo_train.py`: train_demo's `train_step` on its packed rows "
        f"({result['recipe']['tokens_per_step']:,} tokens a step at most, rows of {result['recipe']['row_tokens']:,}).",
        "",
        "| c4 attention | s/step | tokens/step | rows/step | tok/s | device busy | kernels/step | host ops/step "
        "| waits for the GPU/step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for phase, p in result["phases"].items():
        busy = "—" if p["device_busy_share"] is None else f"{p['device_busy_share']:.2f}"
        waits = "—" if p["device_waits"] is None else p["device_waits"]["count"]
        lines.append(f"| {phase} | {p['s_per_step']} | {p['tokens_per_step']:,} | {p['rows_per_step']} | "
                     f"{p['tok_s']:,} | {busy} | {p['kernels_launched'] or '—'} | {p['host_ops']:,} "
                     f"| {waits} |")  # fmt: skip
    lines += ["", f"Whole runs (`train`, sparse c4), {result['scaling_steps']} steps after {WARMUP_STEPS}:", "",
              f"| replicas | row tokens | MPS | tok/s | ÷ one replica, rows of {result['recipe']['row_tokens']:,} "
              "| peak GB |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {r['replicas']} | {r['row_tokens']:,} | {'yes' if r['mps'] else 'no'} | {r['tok_s']:,} | "
              f"{r['vs_one'] or '—'} | {r['peak_memory_gb'] or '—'} |" for r in result["scaling"]]  # fmt: skip
    if result["mps_missing"]:
        lines += ["", f"MPS was asked for and not measured: {result['mps_missing']}."]
    for phase, p in result["phases"].items():
        if p["device_waits"]:
            lines += ["", f"**{phase}, where a step waits for the GPU** (calls a step):", ""]
            lines += [f"- `{place}` × {count}" for place, count in p["device_waits"]["places"].items()]
        for kind in ("top_device_ops", "top_host_ops"):
            if p[kind]:
                lines += ["", f"**{phase}, {kind.replace('_', ' ')}** (self time, ms, one step):", ""]
                lines += [f"- `{o['op'][:90]}` {o['ms']} ms × {o['calls']}" for o in p[kind]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="timed steps per phase")
    parser.add_argument("--samples", type=int, default=20_000, help="samples drawn to pack the steps from")
    parser.add_argument("--replicas", default="1,2,4,8", help="replica counts of the whole runs, comma-separated")
    parser.add_argument(
        "--row-tokens",
        default=str(Recipe.row_tokens),
        help="row lengths of the whole runs, comma-separated (the first is the phases')",
    )
    parser.add_argument("--mps", action="store_true", help="time the runs of several replicas under MPS too")
    parser.add_argument("--held-out", type=Path, default=demo_data.QUALIFICATION_MD, help="the gates' qualification.md")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="the tiny model on the CPU, a few hundred tokens a step")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    row_lengths = [int(n) for n in args.row_tokens.split(",")]
    smoke = {"max_tokens": 1024, "tokens_per_step": 2048, "config": dict(TINY_CONFIG)} if args.smoke else {}
    recipe = Recipe(dense_warmup_steps=1, row_tokens=row_lengths[0], **smoke)
    counts = [int(n) for n in args.replicas.split(",")]
    # before this process uses CUDA; MPS only where there is a GPU
    runs, mps_missing = scaling(recipe, device, counts, row_lengths, args.steps, args.samples, args.held_out,
                                args.mps and device.type == "cuda")  # fmt: skip
    if args.mps and device.type != "cuda":
        mps_missing = "no GPU"
    with differentiable_kernels():
        phases = measure(recipe, device, args.steps, args.samples)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {"device": name, **provenance(), "recipe": dataclasses.asdict(recipe), "phases": phases,
              "scaling_steps": args.steps, "scaling": runs, "mps_missing": mps_missing}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo-train.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "demo-train.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
