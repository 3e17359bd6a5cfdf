"""What every gate shares: the plan a ladder runs to (its scale from the profile's limits, its needle and benchmark
shapes calibrated on the engine's tokenizer), the context a gate runs in, its verdict, and the checks every answer
gets."""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable
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

# Markers of leaked tool markup or corrupted tokens (§2.1, §3.6).
GARBAGE_MARKERS = ("<<tool", "<|", "function=", "\ufffd", "｜DSML｜", "<｜")

HAYSTACK_SENTENCE = "The telemetry service reported nominal readings across all monitored subsystems today."

NEEDLE_SECRET = "ZEBRA-42917-QUARTZ"

NEEDLE_SENTENCE = f"IMPORTANT: The launch code is {NEEDLE_SECRET}."

NEEDLE_QUESTION = "What is the launch code? Reply with the code only."

PERF_FILLER = "def helper_{i}(): return compute({i})\n"

PERF_CHARS_PER_TOKEN = 3

PERF_PLANNED_CONTEXT = 32_768

PERF_REQUESTS = 3

# Calibration: two haystacks of these many sentences give the tokens one sentence adds on this tokenizer (small
# enough for a 1K-token demo context on a byte-level toy tokenizer).
CALIBRATION_SENTENCES = (4, 12)

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


def usage_count(exchange: Exchange, key: str) -> int | None:
    value = (exchange.usage or {}).get(key)
    return value if isinstance(value, int) else None


def cached_tokens(exchange: Exchange) -> int | None:
    details = (exchange.usage or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def verdict_of(problems: list[str], passed: str, measurements: dict[str, Any]) -> Verdict:
    if problems:
        return Verdict(GateStatus.failed, "; ".join(problems), measurements)
    return Verdict(GateStatus.passed, passed, measurements)


def visible_text(exchange: Exchange) -> str:
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
