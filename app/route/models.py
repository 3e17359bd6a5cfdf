"""The agent route's records: agent API keys (stored as sha256), request counts and latency per caller and profile."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow

# Upper bounds (seconds) of the latency histogram buckets; the last bucket holds everything slower.
LATENCY_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class AgentKey(SQLModel, table=True):
    __tablename__ = "agent_key"

    id: int | None = Field(default=None, primary_key=True)
    name: str
    key_sha256: str = Field(unique=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    created_by: str
    last_used_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_by: str | None = None


class RouteUsage(SQLModel, table=True):
    """Requests through the route by one caller to one profile: counts and latency (to the end of the answer)."""

    __tablename__ = "route_usage"

    id: int | None = Field(default=None, primary_key=True)
    # None for the console's own callers (the switch smoke, the production watch's canary).
    key_id: int | None = Field(default=None, foreign_key="agent_key.id", index=True)
    caller: str
    # The profile that served, or "" when none could (no production profile yet).
    profile: str
    requests: int = 0
    # Answers other than 2xx, and streams the engine cut short.
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    # Counts per LATENCY_BUCKETS_S bucket, plus one for slower answers.
    latency_buckets: list[int] = Field(
        default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1), sa_column=Column(JSON, nullable=False)
    )
    last_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
