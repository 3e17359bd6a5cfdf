"""The gate ladder (reference/qualification.md §2): versioned definitions with their exact inputs, pass rules and
measurements, run in order against any OpenAI-compatible endpoint.

A gate's version changes whenever its inputs or its rule change, so results stay comparable only where they
should. Structural gates ask whether the engine serves, survives and how fast; capability gates ask whether the
model answers an agent correctly (a random tiny model fails those, honestly, with the evidence).
"""

from __future__ import annotations

import itertools
import json
import math
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from app.qualification.client import EngineClient, Exchange
from app.qualification.models import GateStatus

LADDER_VERSION = "ladder/1"
GIB = 1 << 30

# The evidence policy: an answer counts only if it ended on its own (or with a tool call).
FINISH_OK = ("stop", "tool_calls")
# Survival gates accept any completed answer, a cut one included: they ask whether the engine answered at all.
FINISH_ANSWERED = ("stop", "length", "tool_calls")
ENVELOPE = {"temperature": 0, "reasoning_effort": "low"}

# Exact inputs (reference/qualification.md §2.1–2.3).
SMOKE_PROMPT = "Write a Python one-liner that returns the sum of a list `xs`."
JSON_PROMPT = 'Return ONLY a JSON object: {"language":"python","ok":true}. No prose.'
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
RESPONSES_INPUT = "Reply with exactly READY"
# Markers of leaked tool markup or corrupted tokens (§2.1, §3.6).
GARBAGE_MARKERS = ("<<tool", "<|", "function=", "\ufffd", "｜DSML｜", "<｜")
HAYSTACK_SENTENCE = "The telemetry service reported nominal readings across all monitored subsystems today."
NEEDLE_SECRET = "ZEBRA-42917-QUARTZ"
NEEDLE_SENTENCE = f"IMPORTANT: The launch code is {NEEDLE_SECRET}."
NEEDLE_DEPTH = 0.58
NEEDLE_QUESTION = "What is the launch code? Reply with the code only."
SHAPE_QUESTION = "Summarise the telemetry above in one sentence."
PERF_FILLER = "def helper_{i}(): return compute({i})\n"
PERF_QUESTION = "Summarise what these helpers do in one sentence."
PERF_CHARS_PER_TOKEN = 3
PERF_PLANNED_CONTEXT = 32_768
PERF_REQUESTS = 3
# Calibration: two haystacks of these many sentences give the tokens one sentence adds on this tokenizer (small
# enough for a 1K-token demo context on a byte-level toy tokenizer).
CALIBRATION_SENTENCES = (4, 12)
# Client-shaped probes (§2.2): (name, prompt tokens, max_tokens) as the field sent them.
CLIENT_SHAPES = (
    ("pi", 19_118, 5_120),
    ("pi_long_output", 512, 32_768),
    ("hermes", 20_000, 5_120),
    ("openclaw", 32_000, 8_192),
)
LOG_PATTERNS = {
    "traceback": re.compile(r"Traceback \(most recent call last\)"),
    "out_of_memory": re.compile(r"out of memory|OutOfMemoryError|cudaErrorMemoryAllocation", re.IGNORECASE),
    "error_level": re.compile(r'"level":\s*"(error|critical|fatal)"|^\s*(ERROR|CRITICAL|FATAL)\b'),
    "http_error": re.compile(r'"event":\s*"request_refused"'),
    "grammar": re.compile(r"xgrammar|FSM error", re.IGNORECASE),
    "signal": re.compile(r"SIGQUIT|sigquit"),
}
LOG_HITS_KEPT = 50
# On the CPU demo every request's output budget: a toy model decodes ~30 tokens/s there, and the ladder must finish
# in minutes.
DEMO_MAX_TOKENS = 32


@dataclass(frozen=True)
class LadderPlan:
    """The concrete sizes of one run: from the profile's limits and the scale. `demo` (the engine on a CPU) keeps
    every shape but shrinks it, so the ladder finishes in minutes on a toy model."""

    served_model: str
    context_length: int
    max_num_seqs: int
    max_num_batched_tokens: int
    scale: str
    max_tokens: int
    burst: int
    tools_system_repeats: int
    # Room kept below the context in near-limit shapes (the needle, client shapes, the benchmark's prompt).
    reserve_tokens: int
    needle_target_tokens: int
    vram_reserve_gib: float
    gpu_indices: tuple[int, ...] = ()

    @classmethod
    def of(
        cls,
        served_model: str,
        limits: dict[str, int],
        device: str | None,
        vram_reserve_gib: float,
        gpu_indices: tuple[int, ...] = (),
    ) -> LadderPlan:
        context = limits["context_length"]
        if device == "cpu":
            max_tokens, burst, repeats, reserve = DEMO_MAX_TOKENS, 3, max(1, context // 128), context // 8
            needle = round(0.75 * context)
            scale = "demo"
        else:
            # Visible 512 plus reasoning headroom (2048 up to 128K, 4096 beyond), capped at 65,536 (§2.0).
            max_tokens = min(512 + (2048 if context <= 131_072 else 4096), 65_536, context // 2)
            burst, repeats, reserve = 20, 400, max(1024, context // 100)
            needle = context - max_tokens - reserve
            scale = "full"
        return cls(
            served_model=served_model,
            context_length=context,
            max_num_seqs=limits["max_num_seqs"],
            max_num_batched_tokens=limits["max_num_batched_tokens"],
            scale=scale,
            max_tokens=max_tokens,
            burst=burst,
            tools_system_repeats=repeats,
            reserve_tokens=reserve,
            needle_target_tokens=needle,
            vram_reserve_gib=vram_reserve_gib,
            gpu_indices=gpu_indices,
        )

    @property
    def perf_max_tokens(self) -> int:
        return DEMO_MAX_TOKENS if self.scale == "demo" else 1024

    @property
    def perf_shape(self) -> dict[str, Any]:
        """The matched benchmark's shape: 32K planned context capped by the profile. Profiles compare only on
        an identical shape."""
        planned = min(PERF_PLANNED_CONTEXT, self.context_length)
        # The demo keeps half its context free: a toy tokenizer packs fewer characters per token than 3.
        reserve = self.context_length // 2 if self.scale == "demo" else 1024
        budget = max(1, min(planned, self.context_length - self.perf_max_tokens - reserve))
        return {
            "planned_context": planned,
            "prompt_budget_tokens": budget,
            "prompt_chars": budget * PERF_CHARS_PER_TOKEN,
            "max_tokens": self.perf_max_tokens,
            "requests": PERF_REQUESTS,
            "concurrency": 1,
            "reasoning_effort": "low",
            "filler": PERF_FILLER.strip(),
        }


@dataclass
class Verdict:
    status: GateStatus
    summary: str
    measurements: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Calibration:
    sentence_tokens: float
    overhead_tokens: float

    def sentences_for(self, tokens: int) -> int:
        return max(1, math.floor((tokens - self.overhead_tokens) / self.sentence_tokens))


class CalibrationFailed(RuntimeError):
    pass


@dataclass
class GateContext:
    """What a gate works with: the client, the plan, and how it leaves evidence and progress behind."""

    client: EngineClient
    plan: LadderPlan
    observe: Callable[[str, dict[str, Any]], None]
    report: Callable[[str], None]
    health: Callable[[], bool]
    read_gpus: Callable[[], dict[str, Any]]
    # The engine's start as the supervisor recorded it (boot stages, load seconds), and its log file.
    boot: dict[str, Any]
    log_path: Path | None
    gate: str = ""
    samples: list[dict[str, Any]] = field(default_factory=list)
    calibration: Calibration | None = None

    def record(self, exchange: Exchange) -> Exchange:
        self.observe(self.gate, exchange.evidence())
        return exchange

    def note(self, observation: str, data: dict[str, Any]) -> None:
        self.observe(self.gate, {"observation": observation, **data})

    def sample_vram(self, point: str) -> None:
        sample = {"point": point, **self.read_gpus()}
        self.samples.append(sample)
        self.note(f"vram[{point}]", sample)

    def chat(self, observation: str, messages: list[dict[str, Any]], **extra: Any) -> Exchange:
        """A chat request in the common envelope; the gate records it once it has checked the answer."""
        body = {"messages": messages, "max_tokens": self.plan.max_tokens, **ENVELOPE, **extra}
        return self.client.chat(observation, body)

    def calibrate(self) -> Calibration:
        """Tokens per haystack sentence on this engine's tokenizer, from two measured prompts: haystacks are sized
        from what the engine counts, never from a words-per-token guess."""
        if self.calibration is None:
            counts = []
            for sentences in CALIBRATION_SENTENCES:
                text = haystack(sentences, None) + "\n\n" + NEEDLE_QUESTION
                exchange = self.record(
                    self.client.chat(
                        f"calibration[{sentences}]",
                        {"messages": [{"role": "user", "content": text}], "max_tokens": 1, **ENVELOPE},
                    )
                )
                tokens = (exchange.usage or {}).get("prompt_tokens")
                if not exchange.ok or not isinstance(tokens, int):
                    raise CalibrationFailed(f"the calibration request failed: {exchange.outcome()}")
                counts.append(tokens)
            (small, large), (n_small, n_large) = counts, CALIBRATION_SENTENCES
            per_sentence = (large - small) / (n_large - n_small)
            self.calibration = Calibration(per_sentence, small - n_small * per_sentence)
        return self.calibration


def haystack(sentences: int, needle_depth: float | None) -> str:
    parts = [HAYSTACK_SENTENCE] * sentences
    if needle_depth is not None:
        parts.insert(round(needle_depth * sentences), NEEDLE_SENTENCE)
    return " ".join(parts)


def user(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def garbage(text: str) -> list[str]:
    return [m for m in GARBAGE_MARKERS if m in text]


def tool_call_problems(exchange: Exchange) -> list[str]:
    """The validator every tool gate shares (§2.1): no garbage in the content, a call to get_weather whose
    arguments parse to an object with a non-empty `city`."""
    problems = [f"garbage marker {m!r} in the content" for m in garbage(exchange.content)]
    if not exchange.tool_calls:
        return [*problems, "no tool_calls"]
    function = (exchange.tool_calls[0] or {}).get("function") or {}
    if function.get("name") != "get_weather":
        problems.append(f"the first call is {function.get('name')!r}, not 'get_weather'")
    problems += [f"garbage marker {m!r} in the arguments" for m in garbage(function.get("arguments") or "")]
    try:
        arguments = json.loads(function.get("arguments") or "")
    except ValueError:
        return [*problems, f"arguments are not JSON: {str(function.get('arguments'))[:120]!r}"]
    if not isinstance(arguments, dict):
        problems.append("arguments are not a JSON object")
    elif not isinstance(arguments.get("city"), str) or not arguments["city"].strip():
        problems.append("arguments lack a non-empty string `city`")
    return problems


def finish_problem(exchange: Exchange, allowed: tuple[str, ...] = FINISH_OK) -> list[str]:
    if not exchange.ok:
        return [exchange.outcome()]
    if exchange.finish_reason not in allowed:
        return [f"finish_reason {exchange.finish_reason!r} (the evidence policy needs {' or '.join(allowed)})"]
    return []


def _usage(exchange: Exchange, key: str) -> int | None:
    value = (exchange.usage or {}).get(key)
    return value if isinstance(value, int) else None


def _cached(exchange: Exchange) -> int | None:
    details = (exchange.usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def _verdict(problems: list[str], passed: str, measurements: dict[str, Any]) -> Verdict:
    if problems:
        return Verdict(GateStatus.failed, "; ".join(problems), measurements)
    return Verdict(GateStatus.passed, passed, measurements)


def _visible(exchange: Exchange) -> str:
    return f"{len(exchange.content)} visible chars, {len(exchange.reasoning)} reasoning chars"


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between the nearest ranks (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = (len(ordered) - 1) * q
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Gate(ABC):
    name: ClassVar[str]
    version: ClassVar[int] = 1
    title: ClassVar[str]
    # structural: does the engine serve, survive, how fast; capability: does the model answer an agent correctly.
    kind: ClassVar[str]
    pass_rule: ClassVar[str]
    measurements: ClassVar[tuple[str, ...]]
    # Gates that read only what the ladder kept (VRAM samples, the log) run even after the engine died.
    needs_engine: ClassVar[bool] = True

    @abstractmethod
    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        """The concrete inputs for this run's plan: what evidence records as the gate's inputs."""

    @abstractmethod
    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        """Ask, check, record every observation; a failed answer is a failed verdict, never an exception."""

    def definition(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "title": self.title,
            "kind": self.kind,
            "pass_rule": self.pass_rule,
            "measurements": list(self.measurements),
            "needs_engine": self.needs_engine,
        }


class Readiness(Gate):
    name, title, kind = "readiness", "Readiness and identity", "structural"
    pass_rule = (
        "/health answers 200; /v1/models lists exactly the profile's served id; /server_info applies the profile's "
        "context_length, max_num_seqs and max_num_batched_tokens and reports a KV capacity"
    )
    measurements = ("load_seconds", "boot_stages", "build", "kv_capacity_tokens", "max_concurrency_at_full_context")

    def inputs(self, plan: LadderPlan) -> dict[str, Any]:
        return {
            "served_model": plan.served_model,
            "limits": {
                "context_length": plan.context_length,
                "max_num_seqs": plan.max_num_seqs,
                "max_num_batched_tokens": plan.max_num_batched_tokens,
            },
        }

    def run(self, ctx: GateContext, inputs: dict[str, Any]) -> Verdict:
        health = ctx.record(ctx.client.get("health", "/health"))
        models = ctx.record(ctx.client.get("models", "/v1/models"))
        info = ctx.record(ctx.client.get("server_info", "/server_info"))
        problems = [] if health.status == 200 else [f"/health: {health.outcome()}"]
        ids = [m.get("id") for m in models.body.get("data", [])] if models.ok and isinstance(models.body, dict) else []
        if ids != [inputs["served_model"]]:
            problems.append(f"/v1/models lists {ids}, not exactly [{inputs['served_model']!r}]")
        body = info.body if info.ok and isinstance(info.body, dict) else {}
        config = body.get("config") or {}
        for key, wanted in inputs["limits"].items():
            if config.get(key) != wanted:
                problems.append(f"/server_info config.{key} is {config.get(key)!r}, the profile says {wanted}")
        capacity = body.get("kv_capacity_tokens")
        if not isinstance(capacity, int) or capacity < 1:
            problems.append(f"/server_info kv_capacity_tokens is {capacity!r}")
        memory = body.get("gpu_memory") or {}
        measurements = {
            "load_seconds": ctx.boot.get("load_seconds"),
            "boot_stages": ctx.boot.get("boot_stages"),
            "build": body.get("build"),
            "served_ids": ids,
            "kv_capacity_tokens": capacity,
            "max_concurrency_at_full_context": body.get("max_concurrency_at_full_context"),
            "weights_bytes": memory.get("weights_bytes"),
            "kv_bytes": memory.get("kv_bytes"),
            "graph_bytes": memory.get("graph_bytes"),
        }
        ctx.sample_vram("idle")
        load = measurements["load_seconds"]
        passed = (
            f"ready{f' after {load:.1f} s' if load is not None else ''}: serves {inputs['served_model']!r}, build "
            f"{body.get('build')}, KV capacity {capacity:,} tokens"
            if isinstance(capacity, int)
            else ""
        )
        return _verdict(problems, passed, measurements)


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
            problems.append(f"no `sum(` in the visible answer ({_visible(answer)})")
        answer.check = {"problems": problems}
        ctx.record(answer)
        return _verdict(problems, "answered with sum(", smoke_measurements(answer))


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
                problems.append(f"no JSON object in the visible answer ({_visible(answer)})")
        answer.check = {"problems": problems, "parsed_keys": keys}
        ctx.record(answer)
        measurements = {"parsed_keys": keys, "seconds": round(answer.seconds, 3), "finish_reason": answer.finish_reason}
        return _verdict(problems, f"a JSON object with keys {keys}", measurements)


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
        cached = [c for c in map(_cached, exchanges) if c is not None]
        prompt = [p for p in (_usage(e, "prompt_tokens") for e in exchanges) if p is not None]
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
        return _verdict(problems, f"a valid streamed call in {exchange.events} events", measurements)


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
        return _verdict(problems, "continued from the tool result: OAKLAND 72F", measurements)


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
        return _verdict(problems, "completed: READY", measurements)


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
        prompt_tokens = _usage(answer, "prompt_tokens")
        found = NEEDLE_SECRET.replace("-", "") in answer.content.replace("-", "").replace(" ", "")
        problems = [answer.outcome()] if not answer.ok else []
        if answer.ok and not found:
            problems.append(f"the launch code is not in the visible answer ({_visible(answer)})")
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
        return _verdict(problems, f"found the code in {where} ({answer.seconds:.1f} s)", measurements)


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
        return _verdict(problems, f"survived: answered in {answer.seconds:.1f} s, /health 200", measurements)


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
                    "prompt_tokens": _usage(answer, "prompt_tokens"),
                    "max_tokens": shape["max_tokens"],
                    "completion_tokens": _usage(answer, "completion_tokens"),
                    "finish_reason": answer.finish_reason,
                    "status": answer.status,
                    "seconds": round(answer.seconds, 3),
                }
            )
            problems += [f"{shape['name']}: {p}" for p in answer.check["problems"]]
        if not ctx.health():
            problems.append("/health stopped answering 200")
        summary = ", ".join(f"{r['name']} {r['prompt_tokens'] or '?'}→{r['completion_tokens'] or '?'}" for r in results)
        return _verdict(problems, f"all answered: {summary}", {"shapes": results})


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
    prompt, completion = _usage(exchange, "prompt_tokens"), _usage(exchange, "completion_tokens")
    ttfo, e2e = exchange.ttfo_s, exchange.seconds
    generation = e2e - ttfo if ttfo is not None else None
    decoded = completion - 1 if completion is not None and completion > 1 else None
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": _cached(exchange),
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


class VramReserve(Gate):
    name, title, kind = "vram_reserve", "Free-VRAM reserve", "structural"
    pass_rule = (
        "every engine GPU keeps at least the reserve free (NVML) idle after load, after the needle and after the "
        "benchmark; n/a without a GPU"
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
        return _verdict(problems, passed, measurements)


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


LADDER: tuple[Gate, ...] = (
    Readiness(),
    Smoke(),
    JsonAnswer(),
    ToolBurst(),
    StreamingTools(),
    ToolResult(),
    Responses(),
    Needle(),
    PostStressSmoke(),
    ClientShapes(),
    Performance(),
    VramReserve(),
    LogScan(),
)
GATES = {gate.name: gate for gate in LADDER}
