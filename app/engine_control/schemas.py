from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec

from app.engine_control.checkpoint import CheckpointState
from app.engine_control.models import RunState

IDLE = "idle"


class StartRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    profile: str


class RestartRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Without `profile`, the latest run's profile starts again."""

    profile: str | None = None


class PreflightCheckRead(msgspec.Struct):
    name: str
    # ok, warn, fail or n/a.
    status: str
    detail: str


class BootStageRead(msgspec.Struct):
    stage: str
    # As the engine reported it: the stage's duration (for `ready` and `failed`, its whole boot).
    seconds: float | None
    # When the console read it, and how long after the launch (process start and imports included).
    at: datetime
    after_s: float
    detail: dict[str, Any]


class GpuReleaseRead(msgspec.Struct):
    # released, held or n/a.
    status: str
    detail: str


class RunRead(msgspec.Struct, kw_only=True):
    id: int
    profile: str
    content_hash: str
    weights_fingerprint: str
    driver: str
    state: RunState
    command: list[str]
    # Set for the engine on top of the console's environment, from the profile (CUDA_VISIBLE_DEVICES for `gpus`).
    environment: dict[str, str]
    preflight: list[PreflightCheckRead]
    started_at: datetime
    started_by: str
    ready_at: datetime | None
    stopped_at: datetime | None
    stopped_by: str | None
    # An operator stopped it by hand: a console restart does not start production again after it.
    keep_stopped: bool
    exit_code: int | None
    pid: int | None
    container: str | None
    log_path: str
    # False once the log fell out of FLASHGATE_LOG_RETENTION.
    log_retained: bool
    boot_stages: list[BootStageRead]
    # While the weights load: {tensors_loaded, tensors_total}.
    load_progress: dict[str, Any] | None
    ready_line: dict[str, Any] | None
    # From the engine's /server_info when it got ready: measured, never estimated.
    kv_capacity_tokens: int | None
    max_concurrency_at_full_context: float | None
    server_info: dict[str, Any] | None
    last_error: str | None
    # The engine's last output lines when the run ended.
    last_lines: list[str]
    gpu_release: GpuReleaseRead | None


class CheckpointRead(msgspec.Struct):
    """The shipped demo checkpoint (cpu-demo's) the console installs on first start."""

    state: CheckpointState
    path: str
    started_at: datetime | None
    finished_at: datetime | None
    detail: str | None


class EngineRead(msgspec.Struct, kw_only=True):
    # "idle" before any run, else the latest run's state.
    state: str
    driver: str
    engine_url: str
    profile: str | None
    run: RunRead | None
    demo_checkpoint: CheckpointRead
    # Who holds the engine now (a qualification run, a switch, the watch, an operator's command), with since when;
    # start, stop and restart answer 423 meanwhile.
    held_by: str | None = None


class LogTail(msgspec.Struct):
    run_id: int
    path: str
    retained: bool
    lines: list[str]
