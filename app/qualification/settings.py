"""Qualification and promotion settings, read from FLASHGATE_* environment variables (listed in the README)."""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class QualificationSettings:
    # The free-VRAM reserve gate: GiB that must stay free on every engine GPU.
    vram_reserve_gib: float
    # How long a drain waits for in-flight requests before the engine is stopped anyway.
    drain_timeout_s: float
    # One gate request may take this long (near-limit probes take minutes on a GPU).
    request_timeout_s: float


def _positive(env: dict[str, str], name: str, default: str) -> float:
    raw = env.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if value <= 0:
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


def load_qualification_settings(env: dict[str, str] | None = None) -> QualificationSettings:
    env = dict(os.environ if env is None else env)
    return QualificationSettings(
        vram_reserve_gib=_positive(env, "FLASHGATE_VRAM_RESERVE_GIB", "3"),
        drain_timeout_s=_positive(env, "FLASHGATE_DRAIN_TIMEOUT_S", "60"),
        request_timeout_s=_positive(env, "FLASHGATE_GATE_REQUEST_TIMEOUT_S", "900"),
    )
