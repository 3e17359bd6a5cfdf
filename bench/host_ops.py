"""What the host issues for one step, per layer kind: torch ops that launch work (views excluded) and Triton kernel
launches, by the engine's source line that issued them. An eager step is bound by this when the GPU finishes first
(bench/results/prefix.md: a cached turn's prefill step, ~300 torch ops a layer, 50-60 ms of host for 34 ms of GPU);
a decode step's CUDA graph replays each launch with its own overhead (issue 23: ~0.13 ms a layer its bytes do not
explain).

It runs on the CPU: the Triton kernels through the interpreter (FLASHGATE_KERNELS=triton, TRITON_INTERPRET=1), so
the step takes the GPU's code path, FP8 cache rows as on the GPU, the tiny checkpoint's layer mix (window-only, c4
with the indexer, c128). What a step issues depends on the code path and the chunk's shape in pages and blocks, not
on the widths, so the counts are the GPU's at the same token counts.

    python bench/host_ops.py --out bench/results     # writes host-ops.json and host-ops.md
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FLASHGATE_KERNELS", "triton")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import provenance  # noqa: E402
from engine.model.loader import load_model  # noqa: E402
from engine.model.state import ForwardBatch  # noqa: E402
from engine.standalone import Standalone  # noqa: E402
from engine.tools.make_tiny import make_tiny  # noqa: E402

# A cached agent turn (bench/prefix.py's, in fewer tokens: the interpreter is slow): new tokens after cached ones,
# each within one block of queries as there; and a decode step of a small batch.
CACHED, NEW, DECODE_BATCH = 1024, 512, 4
SMOKE = 64, 32, 2  # --smoke: the machinery in a minute (CI)
KIND = {0: "window", 4: "c4", 128: "c128"}
ENGINE = str(ROOT / "engine")
# Ops that make views or read metadata: no kernel on the GPU.
VIEWS = {
    "view", "_unsafe_view", "as_strided", "slice", "select", "expand", "t", "transpose", "unsqueeze", "squeeze",
    "permute", "unfold", "alias", "detach", "unflatten", "split", "split_with_sizes", "chunk", "unbind", "narrow",
    "diagonal", "view_as_real", "view_as_complex", "_reshape_alias", "reshape", "flatten", "lift_fresh", "sym_size",
    "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_to_copy_view", "numpy_T", "empty",
    "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense",
}  # fmt: skip
SYNCS = {"_local_scalar_dense", "item", "nonzero", "unique", "_unique2", "masked_select"}
# Ops that launch nothing when they hand back their input (a cast to the dtype it has, an already contiguous tensor).
NO_OP_WHEN_ALIASED = {"to", "contiguous", "type_as"}


def _caller() -> str:
    """The innermost engine frame below the op: file:line function (frames walked, not formatted: it runs per op)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(ENGINE):
            path = Path(frame.f_code.co_filename).relative_to(ROOT)
            return f"{path}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return "outside the engine"


class Counter(TorchDispatchMode):
    """Counts each torch op and Triton launch against the layer running (a forward pre-hook sets it) and the engine
    line that issued it. Ops inside a Triton launch (the interpreter's own copies) are the launch's."""

    def __init__(self):
        super().__init__()
        self.layer = "head"
        self.in_kernel = 0
        self.ops = collections.Counter()  # (layer, "torch" | "triton" | "sync") -> n
        self.lines = collections.Counter()  # (layer, caller, op) -> n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        aliased = name in NO_OP_WHEN_ALIASED and isinstance(out, torch.Tensor) and out.data_ptr() == args[0].data_ptr()
        if not self.in_kernel and not aliased:
            kind = "sync" if name in SYNCS else None if name in VIEWS else "torch"
            if kind:
                self.ops[self.layer, kind] += 1
                self.lines[self.layer, _caller(), name] += 1
        return out

    def launched(self, kernel: str) -> None:
        self.ops[self.layer, "triton"] += 1
        self.lines[self.layer, _caller(), f"triton {kernel}"] += 1


def _hook_triton(counter: Counter):
    """Counts each interpreted launch (GridExecutor.__call__) once, with what it does inside not counted."""
    from triton.runtime.interpreter import GridExecutor

    original = GridExecutor.__call__

    def call(self, *args, **kwargs):
        counter.launched(getattr(self.fn, "__name__", "kernel"))
        counter.in_kernel += 1
        try:
            return original(self, *args, **kwargs)
        finally:
            counter.in_kernel -= 1

    GridExecutor.__call__ = call
    return lambda: setattr(GridExecutor, "__call__", original)


def _batch(tokens: list[list[int]], firsts: list[int], states) -> ForwardBatch:
    ids = torch.tensor([t for seq in tokens for t in seq])
    positions = torch.cat([torch.arange(f, f + len(seq)) for f, seq in zip(firsts, tokens, strict=True)])
    return ForwardBatch(ids, positions, list(states), [len(seq) for seq in tokens])


def count_steps(model_dir: Path, cached: int, new: int, decode_batch: int) -> dict:
    model = load_model(model_dir, torch.bfloat16, "cpu", quant_sim=True)
    runner = Standalone.allocate(model, num_pages=64, num_slots=decode_batch, kv_dtype="fp8_e4m3")
    kinds = [KIND[r] for r in model.args.compress_ratios[: model.args.num_hidden_layers]]
    gen = torch.Generator().manual_seed(0)
    states = [runner.new_state() for _ in range(decode_batch)]
    prompt = torch.randint(2, model.args.vocab_size, (cached + new,), generator=gen).tolist()
    with torch.inference_mode():
        os.environ["FLASHGATE_KERNELS"] = "torch"  # what the cache holds before the steps counted: made faster
        runner(_batch([prompt[:cached]], [0], states[:1]))  # each step advances its requests' states
        for s in states[1:]:  # the decode batch's other requests hold a short prompt each
            runner(_batch([prompt[:40]], [0], [s]))
        os.environ["FLASHGATE_KERNELS"] = "triton"
        # One decode step uncounted: what the engine's warm-up makes once (constants, caches) is not a step's work.
        runner(_batch([[7]] * decode_batch, [s.num_tokens for s in states], states))
        steps = {}
        for name, make in (
            ("prefill", lambda: _batch([prompt[cached:]], [states[0].num_tokens], states[:1])),
            ("decode", lambda: _batch([[7]] * decode_batch, [s.num_tokens for s in states], states)),
        ):
            counter = Counter()
            hooks = [layer.register_forward_pre_hook(lambda _m, _a, k=f"{i}:{kind}", c=counter: setattr(c, "layer", k))
                     for i, (layer, kind) in enumerate(zip(model.layers, kinds, strict=True))]  # fmt: skip
            unhook = _hook_triton(counter)
            batch = make()
            try:
                with counter:
                    model.logits(runner(batch))
            finally:
                unhook()
                for h in hooks:
                    h.remove()
            steps[name] = _summary(counter, kinds, batch)
    return steps


def _summary(counter: Counter, kinds: list[str], batch: ForwardBatch) -> dict:
    layers = {}
    for key in {layer for layer, _ in counter.ops}:
        layers[key] = {kind: counter.ops[key, kind] for kind in ("torch", "triton", "sync")}
    per_kind = {}
    for kind in dict.fromkeys(kinds):
        ids = [f"{i}:{k}" for i, k in enumerate(kinds) if k == kind]
        per_kind[kind] = {op: sum(layers[i][op] for i in ids) // len(ids) for op in ("torch", "triton", "sync")}
    top = collections.Counter()
    for (layer, caller, op), n in counter.lines.items():
        if layer != "head":
            top[layer.split(":")[1], caller, op] += n
    lines = [{"kind": k, "line": c, "op": o, "per_layer": round(n / kinds.count(k), 1)}
             for (k, c, o), n in top.most_common(40)]  # fmt: skip
    by_function = collections.Counter()
    for (kind, caller, _op), n in top.items():
        path, function = caller.split(" ", 1) if " " in caller else (caller, "")
        by_function[kind, f"{path.rsplit(':', 1)[0]} {function}"] += n
    functions = [{"kind": k, "function": f, "per_layer": round(n / kinds.count(k), 1)}
                 for (k, f), n in by_function.most_common(30)]  # fmt: skip
    return {"tokens": len(batch.input_ids), "requests": len(batch.lens), "per_layer_kind": per_kind,
            "head": layers.get("head", {}), "layers": layers, "top_functions": functions,
            "top_lines": lines}  # fmt: skip


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-ops.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [f"# Host ops per step — {result['gpu']}, {result['date']}, commit {result['commit']}", "",
             "`python bench/host_ops.py --out bench/results` (CPU, Triton interpreter: the GPU's code path)",
             ""]  # fmt: skip
    for name, step in result["steps"].items():
        after = f", after {result['cached_tokens']} cached" if name == "prefill" else ""
        lines += [f"## {name}: {step['tokens']} tokens{after}, {step['requests']} request(s)", "",
                  "| layer kind | torch ops | Triton launches | host syncs |", "|---|---|---|---|"]  # fmt: skip
        for kind, n in step["per_layer_kind"].items():
            lines.append(f"| {kind} (each) | {n['torch']} | {n['triton']} | {n['sync']} |")
        head = step["head"]
        lines += [f"| outside the layers | {head.get('torch', 0)} | {head.get('triton', 0)} | {head.get('sync', 0)} |",
                  "", "By the engine function that issued them (torch ops and launches), per layer of the kind:", "",
                  "| kind | per layer | function |", "|---|---|---|"]  # fmt: skip
        lines += [f"| {t['kind']} | {t['per_layer']} | `{t['function']}` |" for t in step["top_functions"][:20]]
        lines += ["", "By line:", "", "| kind | per layer | op | issued at |", "|---|---|---|---|"]
        lines += [f"| {t['kind']} | {t['per_layer']} | {t['op']} | `{t['line']}` |" for t in step["top_lines"][:25]]
        lines.append("")
    (out / "host-ops.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write host-ops.json and host-ops.md here")
    parser.add_argument("--smoke", action="store_true", help=f"cached, new tokens and decode batch {SMOKE}")
    args = parser.parse_args()
    cached, new, decode_batch = SMOKE if args.smoke else (CACHED, NEW, DECODE_BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        steps = count_steps(make_tiny(Path(tmp) / "tiny"), cached, new, decode_batch)
    result = provenance() | {"gpu": "CPU (Triton interpreter)", "cached_tokens": cached, "steps": steps}
    for name, step in steps.items():
        print(name, json.dumps(step["per_layer_kind"]), "head", json.dumps(step["head"]))
    if args.out:
        write_report(result, args.out)


if __name__ == "__main__":
    main()
