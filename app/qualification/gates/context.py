"""Long context: a needle near the limit, and the prompt shapes agents' clients send."""

from __future__ import annotations

from typing import Any

from app.qualification.gates.base import (
    CALIBRATION_SENTENCES,
    ENVELOPE,
    FINISH_ANSWERED,
    HAYSTACK_SENTENCE,
    NEEDLE_QUESTION,
    NEEDLE_SECRET,
    NEEDLE_SENTENCE,
    PERF_PLANNED_CONTEXT,
    CalibrationFailed,
    Gate,
    GateContext,
    LadderPlan,
    Verdict,
    finish_problem,
    haystack,
    usage_count,
    user,
    verdict_of,
    visible_text,
)
from app.qualification.models import GateStatus

NEEDLE_DEPTH = 0.58

SHAPE_QUESTION = "Summarise the telemetry above in one sentence."

# Client-shaped probes (§2.2): (name, prompt tokens, max_tokens) as the field sent them.
CLIENT_SHAPES = (
    ("pi", 19_118, 5_120),
    ("pi_long_output", 512, 32_768),
    ("hermes", 20_000, 5_120),
    ("openclaw", 32_000, 8_192),
)


class Needle(Gate):
    name, title, kind = "needle", "Near-limit needle", "capability"
    pass_rule = (
        "the launch code appears in the visible answer (dashes and spaces stripped from both); the context the "
        "profile proved is the request's usage.prompt_tokens, never the target"
    )
    measurements = ("target_tokens", "prompt_tokens", "proven_prompt_tokens", "fraction_of_context", "seconds")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {
            "sentence": HAYSTACK_SENTENCE,
            "needle": NEEDLE_SENTENCE,
            "depth": NEEDLE_DEPTH,
            "question": NEEDLE_QUESTION,
            "target_tokens": plan.needle_target_tokens,
            "calibration_sentences": list(CALIBRATION_SENTENCES),
            "max_tokens": plan.max_tokens,
            **ENVELOPE,
        }

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        target = inputs["target_tokens"]
        try:
            calibration = ctx.calibrate()
        except CalibrationFailed as exc:
            return Verdict(GateStatus.failed, str(exc), {"target_tokens": target})
        sentences = calibration.sentences_for(target) - 1  # the needle takes about one sentence's room
        ctx.report(f"asking for the code in ~{target:,} tokens ({sentences:,} sentences)")
        answer = ctx.chat("needle", user(haystack(sentences, NEEDLE_DEPTH) + "\n\n" + NEEDLE_QUESTION))
        prompt_tokens = usage_count(answer, "prompt_tokens")
        found = NEEDLE_SECRET.replace("-", "") in answer.content.replace("-", "").replace(" ", "")
        problems = [answer.outcome()] if not answer.ok else []
        if answer.ok and not found:
            problems.append(f"the launch code is not in the visible answer ({visible_text(answer)})")
        answer.check = {"problems": problems, "found": found}
        ctx.record(answer)
        ctx.sample_vram("after_needle")
        measurements = {
            "target_tokens": target,
            "prompt_tokens": prompt_tokens,
            "proven_prompt_tokens": prompt_tokens if answer.ok else None,
            "fraction_of_context": round(prompt_tokens / ctx.plan.context_length, 3) if prompt_tokens else None,
            "tokens_per_sentence": round(calibration.sentence_tokens, 2),
            "seconds": round(answer.seconds, 3),
            "finish_reason": answer.finish_reason,
            "found": found,
        }
        where = f"{prompt_tokens:,} prompt tokens" if prompt_tokens else "the prompt"
        return verdict_of(problems, f"found the code in {where} ({answer.seconds:.1f} s)", measurements)


class ClientShapes(Gate):
    name, title, kind = "client_shapes", "Client-shaped probes", "structural"
    pass_rule = (
        "every shape (Pi 19,118 tokens / 5,120 out, Pi 32,768 out, Hermes 20K / 5,120, OpenClaw 32K / 8,192, each "
        "capped by the profile) is answered with HTTP 200 and /health stays 200: workspace and reserve crashes "
        "that synthetic gates miss"
    )
    measurements = ("shapes",)

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {"shapes": self.shapes(plan), "sentence": HAYSTACK_SENTENCE, "question": SHAPE_QUESTION, **ENVELOPE}

    @staticmethod
    def shapes(plan: LadderPlan) -> list[dict[str, Any]]:
        shapes = []
        for name, prompt, max_tokens in CLIENT_SHAPES:
            if plan.scale == "demo":
                prompt, max_tokens = round(prompt * plan.context_length / PERF_PLANNED_CONTEXT), plan.max_tokens
            max_tokens = min(max_tokens, plan.context_length // 2)
            capped = min(prompt, plan.context_length - max_tokens - plan.reserve_tokens)
            shapes.append(
                {"name": name, "prompt_tokens": max(capped, 1), "max_tokens": max_tokens, "capped": capped < prompt}
            )
        return shapes

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        try:
            calibration = ctx.calibrate()
        except CalibrationFailed as exc:
            return Verdict(GateStatus.failed, str(exc), {})
        results, problems = [], []
        for i, shape in enumerate(inputs["shapes"], 1):
            ctx.report(f"{shape['name']} ({i}/{len(inputs['shapes'])})")
            text = haystack(calibration.sentences_for(shape["prompt_tokens"]), None) + "\n\n" + SHAPE_QUESTION
            answer = ctx.chat(shape["name"], user(text), max_tokens=shape["max_tokens"])
            answer.check = {"problems": finish_problem(answer, FINISH_ANSWERED), "shape": shape}
            ctx.record(answer)
            results.append(
                {
                    "name": shape["name"],
                    "prompt_tokens": usage_count(answer, "prompt_tokens"),
                    "max_tokens": shape["max_tokens"],
                    "completion_tokens": usage_count(answer, "completion_tokens"),
                    "finish_reason": answer.finish_reason,
                    "status": answer.status,
                    "seconds": round(answer.seconds, 3),
                }
            )
            problems += [f"{shape['name']}: {p}" for p in answer.check["problems"]]
        if not ctx.health():
            problems.append("/health stopped answering 200")
        summary = ", ".join(f"{r['name']} {r['prompt_tokens'] or '?'}→{r['completion_tokens'] or '?'}" for r in results)
        return verdict_of(problems, f"all answered: {summary}", {"shapes": results})
