"""Decisions an operator takes on a run's evidence (with per-gate waivers), the route's roles, and the switch
transactions that move the production role."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow

PRODUCTION = "production"


class DecisionKind(StrEnum):
    promote = "promote"
    # Evidence read, not promoted: a decision too, so the record says someone looked.
    no_promotion = "no_promotion"
    reject = "reject"


class PromotionKind(StrEnum):
    promote = "promote"
    rollback = "rollback"


class PromotionStatus(StrEnum):
    running = "running"
    committed = "committed"
    # The target did not come up (or failed its smoke); the previous profile was restored.
    rolled_back = "rolled_back"
    # The target did not come up and neither did the restore: nothing serves.
    failed = "failed"


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


class Route(SQLModel, table=True):
    """Who holds the production role, and the last known good to roll back to (one row per route alias)."""

    alias: str = Field(primary_key=True)
    production_id: int | None = Field(default=None, foreign_key="profile.id")
    rollback_id: int | None = Field(default=None, foreign_key="profile.id")
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_by: str


class Promotion(SQLModel, table=True):
    """One switch transaction: stop what serves, start the target, wait ready, smoke, commit, or restore."""

    id: int | None = Field(default=None, primary_key=True)
    kind: PromotionKind
    target_id: int = Field(foreign_key="profile.id")
    # What was serving (and is stopped), and what is restored if the target fails.
    previous_id: int | None = Field(default=None, foreign_key="profile.id")
    restore_id: int | None = Field(default=None, foreign_key="profile.id")
    decision_id: int | None = Field(default=None, foreign_key="decision.id")
    reason: str
    status: PromotionStatus
    # [{"step", "status", "at", "detail"}], in order.
    steps: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    started_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    started_by: str
    finished_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    # From the stop of what served until something served again (the target, or the restored profile).
    downtime_s: float | None = None
    error: str | None = None
