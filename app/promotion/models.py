"""The switch transactions that move the production role (a promotion or a rollback), step by step."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


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
