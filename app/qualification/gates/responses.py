"""The Responses API."""

from __future__ import annotations

from typing import Any

from app.qualification.gates.base import Gate, GateContext, LadderPlan, Verdict, verdict_of

RESPONSES_INPUT = "Reply with exactly READY"


class Responses(Gate):
    name, title, kind = "responses", "Responses API", "capability"
    pass_rule = "POST /v1/responses answers status `completed` and its output_text, stripped, is exactly READY"
    measurements = ("seconds", "status", "output_text", "reasoning_chars", "usage")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"input": RESPONSES_INPUT, "max_output_tokens": plan.max_tokens, "temperature": 0}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        body = {"input": RESPONSES_INPUT, "max_output_tokens": inputs["max_output_tokens"], "temperature": 0}
        answer = ctx.client.responses("responses", body)
        problems = [answer.outcome()] if answer.status != 200 or answer.error else []
        if not problems and answer.finish_reason != "completed":
            problems.append(f"status {answer.finish_reason!r}, not 'completed'")
        if not problems and answer.content.strip() != "READY":
            problems.append(f"output_text is {answer.content.strip()[:80]!r}, not 'READY'")
        answer.check = {"problems": problems}
        ctx.record(answer)
        measurements = {
            "seconds": round(answer.seconds, 3),
            "status": answer.finish_reason,
            "output_text": answer.content[:200],
            "reasoning_chars": len(answer.reasoning),
            "usage": answer.usage,
        }
        return verdict_of(problems, "completed: READY", measurements)
