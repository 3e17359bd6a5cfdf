"""An engine run: one start of the engine with a profile, from the request to the exit, with what it reported."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class RunState(StrEnum):
    starting = "starting"
    ready = "ready"
    stopping = "stopping"
    stopped = "stopped"
    # It exited (or stopped answering /health) after it was ready.
    crashed = "crashed"
    # It never got ready: exited during boot, reported a failed boot stage, or ran out of boot time.
    failed = "failed"

    @property
    def live(self) -> bool:
        """The engine process exists and may hold the GPUs."""
        return self in (RunState.starting, RunState.ready, RunState.stopping)


class EngineRun(SQLModel, table=True):
    __tablename__ = "engine_run"

    id: int | None = Field(default=None, primary_key=True)
    profile_id: int = Field(foreign_key="profile.id", index=True)
    # What was started: the profile's content and the weights as they were on disk at the start.
    content_hash: str
    weights_fingerprint: str
    driver: str
    state: RunState = Field(index=True)
    # The engine's arguments after `python -m engine serve`.
    command: list[str] = Field(sa_column=Column(JSON, nullable=False))
    # What the engine's environment got from the profile on top of the console's (CUDA_VISIBLE_DEVICES for `gpus`).
    environment: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    preflight: list[dict[str, Any]] = Field(sa_column=Column(JSON, nullable=False))
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_by: str
    ready_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    stopped_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    stopped_by: str | None = None
    # An operator's own stop (the engine controls, not a switch, a qualification run, the watch or the console's
    # shutdown): a console restart leaves production stopped after it (app/route/watch.py).
    keep_stopped: bool = False
    exit_code: int | None = None
    pid: int | None = None
    container: str | None = None
    log_path: str
    boot_stages: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    # The latest `load_progress` event while the weights load: tensors loaded of the total.
    load_progress: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    ready_line: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    # /server_info as the engine answered when it got ready: the measured KV capacity of this run.
    server_info: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    last_error: str | None = None
    last_lines: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    gpu_release: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
