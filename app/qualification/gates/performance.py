"""Performance: time to first token and output, prefill and decode rates, on the benchmark shape."""

from __future__ import annotations

import time
from typing import Any

from app.qualification.client import Exchange
from app.qualification.gates.base import (
    ENVELOPE,
    PERF_FILLER,
    Gate,
    GateContext,
    LadderPlan,
    Verdict,
    cached_tokens,
    percentile,
    usage_count,
    user,
)
from app.qualification.models import GateStatus

PERF_QUESTION = "Summarise what these helpers do in one sentence."


class Performance(Gate):
    name, title, kind = "performance", "Matched performance", "structural"
    pass_rule = (
        "3 streamed requests at concurrency 1 on the fixed shape all complete (HTTP 200, [DONE], usage); TTFO, TTFT, "
        "E2E, prefill and decode tok/s are measured on the client clock and reported as p50/p95"
    )
    measurements = ("shape", "p50", "p95", "aggregate_tok_s", "cached_tokens_avg", "visible_content", "requests")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"shape": plan.perf_shape, "question": PERF_QUESTION, **ENVELOPE}

    @staticmethod
    def prompt(shape: dict[str, Any]) -> str:
        lines, size, i = [], 0, 0
        while size < shape["prompt_chars"]:
            line = PERF_FILLER.format(i=i)
            lines.append(line)
            size += len(line)
            i += 1
        return "".join(lines) + "\n" + PERF_QUESTION

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        shape = inputs["shape"]
        prompt = self.prompt(shape)
        requests, problems = [], []
        start = time.perf_counter()
        for i in range(shape["requests"]):
            ctx.report(f"request {i + 1}/{shape['requests']}")
            body = {"messages": user(prompt), "max_tokens": shape["max_tokens"], **ENVELOPE}
            exchange = ctx.client.stream_chat(f"performance[{i}]", body)
            metrics = request_metrics(exchange)
            exchange.check = metrics
            ctx.record(exchange)
            requests.append(metrics)
            if not exchange.ok or not exchange.done or metrics["completion_tokens"] is None:
                problems.append(f"request {i + 1}: {exchange.outcome()}{'' if exchange.done else ', no [DONE]'}")
        wall = time.perf_counter() - start
        ctx.sample_vram("after_benchmark")
        output = sum(r["completion_tokens"] or 0 for r in requests)
        cached = [r["cached_tokens"] for r in requests if r["cached_tokens"] is not None]
        names = ("ttfo_s", "ttft_s", "e2e_s", "prefill_tok_s", "decode_tok_s", "itl_s")
        measurements = {
            "shape": shape,
            "p50": {n: _round(percentile([r[n] for r in requests if r[n] is not None], 0.5)) for n in names},
            "p95": {n: _round(percentile([r[n] for r in requests if r[n] is not None], 0.95)) for n in names},
            "aggregate_tok_s": _round(output / wall if wall > 0 else None),
            "wall_s": round(wall, 3),
            "completed": f"{len(requests) - len(problems)}/{len(requests)}",
            "cached_tokens_avg": round(sum(cached) / len(cached), 1) if cached else None,
            "visible_content": f"{sum(1 for r in requests if r['visible'])}/{len(requests)}",
            "requests": requests,
        }
        p50 = measurements["p50"]
        summary = (
            f"{measurements['completed']} done; p50 TTFO {_fmt(p50['ttfo_s'], 's')}, TTFT {_fmt(p50['ttft_s'], 's')}, "
            f"E2E {_fmt(p50['e2e_s'], 's')}, prefill {_fmt(p50['prefill_tok_s'], 'tok/s')}, "
            f"decode {_fmt(p50['decode_tok_s'], 'tok/s')}"
        )
        if problems:
            return Verdict(GateStatus.failed, f"{summary}; {'; '.join(problems)}", measurements)
        return Verdict(GateStatus.passed, summary, measurements)


def request_metrics(exchange: Exchange) -> dict[str, Any]:
    """The reference's client-clock formulas (§2.3). Prefill tok/s includes queueing (it is prompt / TTFO)."""
    prompt, completion = usage_count(exchange, "prompt_tokens"), usage_count(exchange, "completion_tokens")
    ttfo, e2e = exchange.ttfo_s, exchange.seconds
    generation = e2e - ttfo if ttfo is not None else None
    decoded = completion - 1 if completion is not None and completion > 1 else None
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached_tokens(exchange),
        "ttfo_s": _round(ttfo),
        "ttft_s": _round(exchange.ttft_s),
        "e2e_s": _round(e2e),
        "generation_s": _round(generation),
        "prefill_tok_s": _round(prompt / ttfo) if prompt and ttfo else None,
        "decode_tok_s": _round(decoded / generation) if decoded and generation else None,
        "itl_s": _round(generation / decoded) if decoded and generation else None,
        "visible": bool(exchange.content),
        "finish_reason": exchange.finish_reason,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.2f} {unit}" if unit == "s" else f"{value:,.1f} {unit}"
