"""The audit trail: one row per state change, written in the same transaction as the change; and alerts, what an
operator must see (production crashed, hung, restarted, rolled back, or left without an engine), open until
acknowledged."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class Audit(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    actor: str
    action: str
    target: str = Field(index=True)
    before: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    after: dict[str, Any] | None = Field(default=None, sa_column=Column(JSON))
    request_id: str | None = None


class AlertLevel(StrEnum):
    warning = "warning"
    error = "error"


class Alert(SQLModel, table=True):
    """Something an operator must see: production crashed, hung, was restarted or rolled back. Open until
    acknowledged."""

    id: int | None = Field(default=None, primary_key=True)
    at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    level: AlertLevel
    profile: str | None = None
    message: str
    acknowledged_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    acknowledged_by: str | None = None
