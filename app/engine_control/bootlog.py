"""What the supervisor reads in the engine's output (DESIGN.md, "Engine ↔ console contract"): JSON `boot_stage`
events and the verbatim ready line. Everything else is log text, kept but not interpreted."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

BOOT_STAGES = ("weights", "kv_alloc", "graph_capture", "ready", "failed")
READY_LINE = re.compile(
    r"engine ready: context_len=(?P<context_len>\d+) max_total_num_tokens=(?P<max_total_num_tokens>\d+) "
    r"max_num_seqs=(?P<max_num_seqs>\d+) max_num_batched_tokens=(?P<max_num_batched_tokens>\d+) "
    r"available_gpu_mem=(?P<available_gpu_mem_gib>[0-9.]+)GiB"
)


@dataclass(frozen=True)
class BootStage:
    stage: str
    seconds: float | None
    # The event's other fields (an error message for "failed", sizes, ...), minus logging noise.
    detail: dict[str, Any]


@dataclass(frozen=True)
class ReadyLine:
    values: dict[str, int | float]


@dataclass(frozen=True)
class LoadProgress:
    """The engine's `load_progress` event: not in the contract, but the only sign of life in a minutes-long load."""

    tensors_loaded: int
    tensors_total: int


_NOISE = {"event", "stage", "seconds", "level", "timestamp", "logger"}


def parse_line(line: str) -> BootStage | ReadyLine | LoadProgress | None:
    if (match := READY_LINE.search(line)) is not None:
        return ReadyLine({k: float(v) if "." in v else int(v) for k, v in match.groupdict().items()})
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        event = json.loads(text)
    except ValueError:
        return None
    if not isinstance(event, dict):
        return None
    if event.get("event") == "load_progress":
        try:
            return LoadProgress(int(event["tensors_loaded"]), int(event["tensors_total"]))
        except (KeyError, TypeError, ValueError):
            return None
    if event.get("event") != "boot_stage" or event.get("stage") not in BOOT_STAGES:
        return None
    seconds = event.get("seconds")
    return BootStage(
        stage=event["stage"],
        seconds=float(seconds) if isinstance(seconds, int | float) else None,
        detail={k: v for k, v in event.items() if k not in _NOISE},
    )
