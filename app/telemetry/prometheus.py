"""A small reader of the Prometheus text format (what the engine's /metrics answers): samples by name, labels kept.

The console reads a handful of the engine's own series; a parser of ~40 lines keeps prometheus_client (an engine
dependency) out of the console.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _value(raw: str) -> float:
    return {"+Inf": math.inf, "-Inf": -math.inf}.get(raw) or float(raw)


def parse(text: str) -> dict[str, list[Sample]]:
    """Samples by metric name (a histogram's `_bucket`, `_sum` and `_count` are names of their own). Comments and
    lines that are not samples are skipped."""
    samples: dict[str, list[Sample]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#") or not (match := _SAMPLE.match(line)):
            continue
        name, labels, raw = match.groups()
        try:
            value = _value(raw)
        except ValueError:
            continue
        parsed = {
            key: re.sub(r"\\[\\\"n]", lambda m: _UNESCAPE[m.group()], val) for key, val in _LABEL.findall(labels or "")
        }
        samples.setdefault(name, []).append(Sample(name, parsed, value))
    return samples


def total(samples: dict[str, list[Sample]], name: str) -> float | None:
    """The sum over a metric's label sets, or None when the engine does not report it."""
    found = samples.get(name)
    return sum(s.value for s in found) if found else None
