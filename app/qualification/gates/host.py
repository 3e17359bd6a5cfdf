"""What the ladder kept of the host: the free VRAM reserve, and the engine's log scanned for errors."""

from __future__ import annotations

import re
from typing import Any

from app.qualification.gates.base import GIB, Gate, GateContext, LadderPlan, Verdict, verdict_of
from app.qualification.models import GateStatus

LOG_PATTERNS = {
    "traceback": re.compile(r"Traceback \(most recent call last\)"),
    "out_of_memory": re.compile(r"out of memory|OutOfMemoryError|cudaErrorMemoryAllocation", re.IGNORECASE),
    "error_level": re.compile(r'"level":\s*"(error|critical|fatal)"|^\s*(ERROR|CRITICAL|FATAL)\b'),
    "http_error": re.compile(r'"event":\s*"request_refused"'),
    "grammar": re.compile(r"xgrammar|FSM error", re.IGNORECASE),
    "signal": re.compile(r"SIGQUIT|sigquit"),
}

LOG_HITS_KEPT = 50


class VramReserve(Gate):
    name, title, kind = "vram_reserve", "Free-VRAM reserve", "structural"
    # 2: a GPU of the engine's that a reading lacks is a failure (one engine over several GPUs), not skipped.
    version = 2
    pass_rule = (
        "every engine GPU (each of the profile's tensor_parallel_size, its gpus when named) keeps at least the reserve "
        "free (NVML) idle after load, after the needle and after the benchmark; n/a without a GPU"
    )
    measurements = ("samples", "min_free_gib")
    needs_engine = False
    POINTS = ("idle", "after_needle", "after_benchmark")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"reserve_gib": plan.vram_reserve_gib, "points": list(self.POINTS), "gpus": list(plan.gpu_indices)}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        samples = ctx.samples
        if not any(s["available"] for s in samples):
            reading = samples[0] if samples else ctx.read_gpus()
            if not reading["available"]:
                return Verdict(GateStatus.na, f"n/a: no GPU ({reading['reason']})", {"samples": samples})
        reserve = inputs["reserve_gib"]
        problems = [f"not sampled {p.replace('_', ' ')}" for p in self.POINTS if p not in {s["point"] for s in samples}]
        free = []
        for sample in samples:
            shown = {gpu["index"] for gpu in sample.get("gpus", [])}
            if sample.get("available") and (missing := [i for i in inputs["gpus"] if i not in shown]):
                listed = ", ".join(str(i) for i in missing)
                problems.append(f"{sample['point']}: GPU {listed} of the engine not in NVML's reading")
            for gpu in sample.get("gpus", []):
                if gpu["index"] not in inputs["gpus"]:
                    continue
                if gpu["free_bytes"] is None:
                    problems.append(f"{sample['point']}: GPU {gpu['index']} reports no free memory (NVML)")
                    continue
                free.append(gpu["free_bytes"] / GIB)
                if gpu["free_bytes"] / GIB < reserve:
                    problems.append(
                        f"{sample['point']}: GPU {gpu['index']} has {gpu['free_bytes'] / GIB:.2f} GiB free "
                        f"< {reserve:g} GiB"
                    )
        measurements = {"samples": samples, "min_free_gib": round(min(free), 2) if free else None}
        passed = f"at least {min(free, default=0):.2f} GiB free on every engine GPU (reserve {reserve:g} GiB)"
        return verdict_of(problems, passed, measurements)


class LogScan(Gate):
    name, title, kind = "log_scan", "Engine log scan", "structural"
    pass_rule = (
        "the engine's log over the run has no traceback, out-of-memory, error-level line, refused request "
        "(HTTP 429/5xx), grammar/FSM error or SIGQUIT"
    )
    measurements = ("hits", "lines_scanned", "kinds")
    needs_engine = False

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"patterns": {name: pattern.pattern for name, pattern in LOG_PATTERNS.items()}}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        if ctx.log_path is None:
            return Verdict(GateStatus.na, "n/a: the engine never started, so it wrote no log", {})
        if not ctx.log_path.is_file():
            return Verdict(GateStatus.failed, f"the engine log is gone ({ctx.log_path}): nothing to scan", {})
        hits, kinds, scanned = [], {}, 0
        with ctx.log_path.open(errors="replace") as log:
            for number, line in enumerate(log, 1):
                scanned = number
                for kind, pattern in LOG_PATTERNS.items():
                    if pattern.search(line):
                        kinds[kind] = kinds.get(kind, 0) + 1
                        if len(hits) < LOG_HITS_KEPT:
                            hits.append({"line": number, "kind": kind, "text": line.rstrip()[:400]})
                        break
        ctx.note("log_scan", {"log_path": str(ctx.log_path), "lines_scanned": scanned, "hits": hits})
        measurements = {"hits": sum(kinds.values()), "lines_scanned": scanned, "kinds": kinds}
        if kinds:
            found = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in kinds.items())
            return Verdict(
                GateStatus.failed, f"{found} in {scanned:,} lines (first at line {hits[0]['line']})", measurements
            )
        return Verdict(GateStatus.passed, f"clean: {scanned:,} lines", measurements)
