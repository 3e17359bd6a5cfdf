"""A profile: the model and the limits the engine is started with, plus the route's output clamp."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, Column
from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class Profile(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    parent_id: int | None = Field(default=None, foreign_key="profile.id", index=True)
    # The one thing changed from the parent (or, for a root profile, where it comes from).
    rationale: str
    # A directory under FLASHGATE_MODELS_DIR.
    model: str
    revision: str | None = None
    dtype: str
    context_length: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float
    kv_cache_dtype: str
    cuda_graph_max_bs: int
    tensor_parallel_size: int
    # data-parallel or tensor-parallel (schema version 6; earlier profiles read data-parallel, the engine's default).
    attention: str = "data-parallel"
    # The host's GPU indices for CUDA_VISIBLE_DEVICES; None: the first tensor_parallel_size the console sees.
    gpus: list[int] | None = Field(default=None, sa_column=Column(JSON))
    max_output_tokens: int
    engine_extras: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    content_hash: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    created_by: str
    retired: bool = False
    retired_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    retired_by: str | None = None


# The one route alias's row: its production profile and the last known good.
PRODUCTION = "production"


class Route(SQLModel, table=True):
    """Who holds the production role, and the last known good to roll back to (one row per route alias)."""

    alias: str = Field(primary_key=True)
    production_id: int | None = Field(default=None, foreign_key="profile.id")
    rollback_id: int | None = Field(default=None, foreign_key="profile.id")
    updated_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    updated_by: str
