"""Plain answers: a smoke completion, a JSON answer, and the smoke again after the stress of the others."""

from __future__ import annotations

import json
from typing import Any

from app.qualification.client import Exchange
from app.qualification.gates.base import (
    ENVELOPE,
    FINISH_ANSWERED,
    Gate,
    GateContext,
    LadderPlan,
    Verdict,
    finish_problem,
    user,
    verdict_of,
    visible_text,
)

# Exact inputs (reference/qualification.md §2.1–2.3).
SMOKE_PROMPT = "Write a Python one-liner that returns the sum of a list `xs`."

JSON_PROMPT = 'Return ONLY a JSON object: {"language":"python","ok":true}. No prose.'


class Smoke(Gate):
    name, title, kind = "smoke", "Smoke", "capability"
    pass_rule = "the visible content contains `sum(`; finish_reason stop"
    measurements = ("seconds", "finish_reason", "visible_chars", "reasoning_chars", "usage")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"prompt": SMOKE_PROMPT, "max_tokens": plan.max_tokens, **ENVELOPE}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        answer = ctx.chat("smoke", user(SMOKE_PROMPT))
        problems = finish_problem(answer)
        if answer.ok and "sum(" not in answer.content:
            problems.append(f"no `sum(` in the visible answer ({visible_text(answer)})")
        answer.check = {"problems": problems}
        ctx.record(answer)
        return verdict_of(problems, "answered with sum(", smoke_measurements(answer))


def smoke_measurements(answer: Exchange) -> dict[str, Any]:
    return {
        "seconds": round(answer.seconds, 3),
        "finish_reason": answer.finish_reason,
        "visible_chars": len(answer.content),
        "reasoning_chars": len(answer.reasoning),
        "usage": answer.usage,
    }


class JsonAnswer(Gate):
    name, title, kind = "json", "JSON answer", "capability"
    pass_rule = "the text from the first `{` to the last `}` parses as JSON with key `language`; finish_reason stop"
    measurements = ("parsed_keys", "seconds", "finish_reason")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"prompt": JSON_PROMPT, "response_format": None, "max_tokens": plan.max_tokens, **ENVELOPE}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        answer = ctx.chat("json", user(JSON_PROMPT))
        problems = finish_problem(answer)
        keys: list[str] = []
        if answer.ok:
            text = answer.content
            start, end = text.find("{"), text.rfind("}")
            try:
                parsed = json.loads(text[start : end + 1]) if 0 <= start < end else None
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                keys = sorted(parsed)
                if "language" not in parsed:
                    problems.append(f"the JSON object has no `language` (keys {keys})")
            else:
                problems.append(f"no JSON object in the visible answer ({visible_text(answer)})")
        answer.check = {"problems": problems, "parsed_keys": keys}
        ctx.record(answer)
        measurements = {"parsed_keys": keys, "seconds": round(answer.seconds, 3), "finish_reason": answer.finish_reason}
        return verdict_of(problems, f"a JSON object with keys {keys}", measurements)


class PostStressSmoke(Gate):
    name, title, kind = "post_stress_smoke", "Post-stress smoke", "structural"
    pass_rule = (
        "right after the needle, the smoke request is answered (HTTP 200, finish_reason stop, length or tool_calls) "
        "and /health still answers 200; the smoke's own `sum(` check is recorded, not required"
    )
    measurements = ("seconds", "finish_reason", "smoke_check", "health")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"prompt": SMOKE_PROMPT, "max_tokens": plan.max_tokens, **ENVELOPE}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        answer = ctx.chat("post_stress_smoke", user(SMOKE_PROMPT))
        healthy = ctx.health()
        problems = finish_problem(answer, FINISH_ANSWERED)
        answer.check = {"problems": problems, "smoke_check": "sum(" in answer.content}
        ctx.record(answer)
        if not healthy:
            problems.append("/health stopped answering 200")
        measurements = {**smoke_measurements(answer), "smoke_check": "sum(" in answer.content, "health": healthy}
        return verdict_of(problems, f"survived: answered in {answer.seconds:.1f} s, /health 200", measurements)
