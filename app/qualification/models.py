"""Evidence: what a qualification gate observed about a profile. The qualification issue fills in gates and runs;
the table exists now because evidence is what makes a profile immutable."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class Evidence(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    profile_id: int = Field(foreign_key="profile.id", index=True)
    gate: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    payload: dict[str, Any] = Field(sa_column=Column(JSON, nullable=False))
