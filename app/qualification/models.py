"""Qualification: a run of the gate ladder against an engine started with a profile, each gate's result, and the
evidence every observation left (failures included). Evidence is what makes a profile immutable."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class RunStatus(StrEnum):
    # Waiting for the engine the run displaces to drain and stop.
    waiting = "waiting"
    starting = "starting"
    running = "running"
    passed = "passed"
    failed = "failed"
    # The ladder stopped: the engine never got ready, died, or was taken away; the gates left say "not run".
    aborted = "aborted"

    @property
    def finished(self) -> bool:
        return self in (RunStatus.passed, RunStatus.failed, RunStatus.aborted)


class GateStatus(StrEnum):
    pending = "pending"
    running = "running"
    passed = "passed"
    failed = "failed"
    # The gate cannot apply here (free VRAM on a CPU host); the summary says why.
    na = "n/a"
    not_run = "not_run"


class QualificationRun(SQLModel, table=True):
    __tablename__ = "qualification_run"

    id: int | None = Field(default=None, primary_key=True)
    profile_id: int = Field(foreign_key="profile.id", index=True)
    # What the evidence is about: this profile content, these weights, this engine build. A change of any makes
    # the run stale.
    content_hash: str
    weights_fingerprint: str | None = None
    engine_build: str | None = None
    engine_run_id: int | None = Field(default=None, foreign_key="engine_run.id")
    # The ladder's version: its gates and their versions, in order.
    ladder: str
    # `full` on a GPU; `demo` (scaled inputs) when the engine runs on the CPU. Known once the engine is ready.
    scale: str | None = None
    status: RunStatus
    # The gate running now: {"gate", "index", "total", "step", "gate_started_at"}.
    progress: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_by: str
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # Why the ladder stopped early (aborted runs only).
    stop_reason: str | None = None
    # The engine this run displaced: which profile, how long the drain took, the downtime until it was back.
    disruption: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))


class GateResult(SQLModel, table=True):
    __tablename__ = "gate_result"

    id: int | None = Field(default=None, primary_key=True)
    run_id: int = Field(foreign_key="qualification_run.id", index=True)
    position: int
    gate: str
    version: int
    # A GateStatus value, stored as its value: "n/a" is no Python name, and an Enum column would store names.
    status: str
    summary: str
    # The concrete inputs this run used (prompts by name, sizes, budgets), and what the gate measured.
    inputs: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    measurements: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    started_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Evidence(SQLModel, table=True):
    """One observation: the request (long text shortened, with its length and sha256), the response excerpt, timings
    and usage."""

    id: int | None = Field(default=None, primary_key=True)
    profile_id: int = Field(foreign_key="profile.id", index=True)
    run_id: int | None = Field(default=None, foreign_key="qualification_run.id", index=True)
    gate: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    payload: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))


class DecisionKind(StrEnum):
    promote = "promote"
    # Evidence read, not promoted: a decision too, so the record says someone looked.
    no_promotion = "no_promotion"
    reject = "reject"


class Decision(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    profile_id: int = Field(foreign_key="profile.id", index=True)
    run_id: int = Field(foreign_key="qualification_run.id")
    decision: DecisionKind
    reason: str
    operator: str
    # The content the decision is about: a later change of the profile's content leaves it behind.
    content_hash: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)


class Waiver(SQLModel, table=True):
    """A failed gate an operator accepts for one promotion decision, with the reason."""

    id: int | None = Field(default=None, primary_key=True)
    decision_id: int = Field(foreign_key="decision.id", index=True)
    gate: str
    reason: str
    operator: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
