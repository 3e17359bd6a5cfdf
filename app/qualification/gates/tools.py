"""Tool calls: a burst of them, streamed ones, and the answer to a tool's result."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.qualification.client import Exchange
from app.qualification.gates.base import (
    ENVELOPE,
    Gate,
    GateContext,
    LadderPlan,
    Verdict,
    cached_tokens,
    finish_problem,
    tool_call_problems,
    usage_count,
    verdict_of,
)
from app.qualification.models import GateStatus

TOOLS_SYSTEM_LINE = "You are a coding specialist agent. Follow the harness contract."

TOOLS_USER = "What's the weather in Oakland? Use the tool."

GET_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

TOOL_RESULT = '{"city":"Oakland","temperature_f":72,"condition":"sunny"}'

TOOL_RESULT_USER = "Reply exactly OAKLAND 72F using the tool result."


def tools_messages(plan: LadderPlan) -> list[dict[str, Any]]:
    system = "\n".join([TOOLS_SYSTEM_LINE] * plan.tools_system_repeats)
    return [{"role": "system", "content": system}, {"role": "user", "content": TOOLS_USER}]


def _tools_inputs(plan: LadderPlan) -> dict[str, Any]:
    return {
        "system": f"{TOOLS_SYSTEM_LINE!r} × {plan.tools_system_repeats}",
        "user": TOOLS_USER,
        "tools": [GET_WEATHER],
        "tool_choice": "auto",
        "max_tokens": plan.max_tokens,
        **ENVELOPE,
    }


class ToolBurst(Gate):
    name, title, kind = "tools", "Concurrent shared-prefix tool burst", "capability"
    pass_rule = (
        "every response: no garbage markers in the content, a non-empty tool_calls whose first call is get_weather "
        "with arguments that parse to an object with a non-empty `city`"
    )
    measurements = ("clean", "requests", "cached_tokens_avg", "prompt_tokens_avg", "wall_s")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {**_tools_inputs(plan), "concurrent_requests": plan.burst}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        messages, n = tools_messages(ctx.plan), inputs["concurrent_requests"]
        body = {"messages": messages, "tools": [GET_WEATHER], "tool_choice": "auto", "max_tokens": ctx.plan.max_tokens}
        start = time.perf_counter()
        answered = itertools.count(1)

        def one(i: int) -> Exchange:
            exchange = ctx.client.chat(f"tools[{i}]", {**body, **ENVELOPE})
            ctx.report(f"{next(answered)}/{n} answered")  # count() hands out each number once, across threads
            return exchange

        ctx.report(f"0/{n} answered")
        with ThreadPoolExecutor(max_workers=n) as pool:
            exchanges = list(pool.map(one, range(n)))
        wall = time.perf_counter() - start
        failures = []
        for exchange in exchanges:
            problems = [exchange.outcome()] if not exchange.ok else tool_call_problems(exchange)
            exchange.check = {"problems": problems}
            ctx.record(exchange)
            if problems:
                failures.append(f"{exchange.observation}: {problems[0]}")
        clean = n - len(failures)
        cached = [c for c in map(cached_tokens, exchanges) if c is not None]
        prompt = [p for p in (usage_count(e, "prompt_tokens") for e in exchanges) if p is not None]
        measurements = {
            "clean": f"{clean}/{n}",
            "requests": n,
            "cached_tokens_avg": round(sum(cached) / len(cached), 1) if cached else None,
            "prompt_tokens_avg": round(sum(prompt) / len(prompt), 1) if prompt else None,
            "wall_s": round(wall, 3),
        }
        summary = f"{clean}/{n} clean" + (f"; {'; '.join(failures[:3])}" if failures else "")
        if failures:
            return Verdict(GateStatus.failed, summary, measurements)
        return Verdict(GateStatus.passed, summary, measurements)


class StreamingTools(Gate):
    name, title, kind = "streaming_tools", "Streaming tool call", "capability"
    pass_rule = (
        "calls reassembled by index are valid (the tools validator), `[DONE]` arrived, and the last non-null "
        "finish_reason is tool_calls"
    )
    measurements = ("seconds", "events", "done", "finish_reason")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {**_tools_inputs(plan), "stream": True, "stream_options": {"include_usage": True}}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        body = {"messages": tools_messages(ctx.plan), "tools": [GET_WEATHER], "tool_choice": "auto"}
        exchange = ctx.client.stream_chat("streaming_tools", {**body, "max_tokens": ctx.plan.max_tokens, **ENVELOPE})
        problems = [exchange.outcome()] if not exchange.ok else tool_call_problems(exchange)
        if exchange.status == 200 and not exchange.done:
            problems.append("no `data: [DONE]`")
        if exchange.ok and exchange.finish_reason != "tool_calls":
            problems.append(f"the last finish_reason is {exchange.finish_reason!r}, not 'tool_calls'")
        exchange.check = {"problems": problems}
        ctx.record(exchange)
        measurements = {
            "seconds": round(exchange.seconds, 3),
            "events": exchange.events,
            "done": exchange.done,
            "finish_reason": exchange.finish_reason,
        }
        return verdict_of(problems, f"a valid streamed call in {exchange.events} events", measurements)


class ToolResult(Gate):
    name, title, kind = "tool_result", "Tool-result continuation", "capability"
    pass_rule = (
        "turn 1 yields a valid get_weather call; turn 2 (the call, its tool result, no tools) answers with "
        "content that, case-folded without spaces, contains `oakland` and `72f`"
    )
    measurements = ("turn1_seconds", "turn2_seconds", "turn2_content")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {**_tools_inputs(plan), "tool_result": TOOL_RESULT, "turn2_user": TOOL_RESULT_USER}

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        messages = tools_messages(ctx.plan)
        first = ctx.chat("turn1", messages, tools=[GET_WEATHER], tool_choice="auto")
        problems = [first.outcome()] if not first.ok else tool_call_problems(first)
        first.check = {"problems": problems}
        ctx.record(first)
        measurements: dict[str, Any] = {"turn1_seconds": round(first.seconds, 3)}
        if problems:
            return Verdict(GateStatus.failed, f"turn 1 gave no valid tool call: {problems[0]}", measurements)
        call = first.tool_calls[0]
        history = [
            *messages,
            {"role": "assistant", "content": first.content, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call.get("id"), "content": TOOL_RESULT},
            {"role": "user", "content": TOOL_RESULT_USER},
        ]
        second = ctx.chat("turn2", history)
        folded = second.content.casefold().replace(" ", "")
        problems = finish_problem(second)
        if second.ok and not ("oakland" in folded and "72f" in folded):
            problems.append(f"turn 2 does not say OAKLAND 72F: {second.content[:120]!r}")
        second.check = {"problems": problems}
        ctx.record(second)
        measurements |= {"turn2_seconds": round(second.seconds, 3), "turn2_content": second.content[:200]}
        return verdict_of(problems, "continued from the tool result: OAKLAND 72F", measurements)
