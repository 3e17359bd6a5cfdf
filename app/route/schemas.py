from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


class KeyCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class KeyRead(msgspec.Struct, kw_only=True):
    name: str
    created_at: datetime
    created_by: str
    last_used_at: datetime | None
    revoked_at: datetime | None
    revoked_by: str | None
    # Requests this key sent through the route, and how many were not answered with 2xx.
    requests: int
    errors: int


class IssuedKey(KeyRead, kw_only=True):
    """A new key with its secret: the only time the secret is shown."""

    key: str


class UsageRead(msgspec.Struct, kw_only=True):
    """Requests through the route, for one key (or console caller) or one profile."""

    name: str
    requests: int
    errors: int
    mean_s: float | None
    # An upper bound of the 50th / 95th percentile: its latency bucket's bound or the slowest request, the lower.
    p50_le_s: float | None
    p95_le_s: float | None
    max_s: float | None
    last_at: datetime | None


class MetricsRead(msgspec.Struct, kw_only=True):
    alias: str
    by_key: list[UsageRead]
    by_profile: list[UsageRead]


class ClientConfigRead(msgspec.Struct, kw_only=True):
    """A client's configuration for the route, from the production profile and its engine's /server_info."""

    client: str
    # Where the content goes (a file for Pi, a snippet for any OpenAI client).
    target: str
    content: str
    base_url: str
    model: str
    profile: str
    context_window: int
    max_tokens: int
    # The Pi models.json object itself (None for the snippet).
    config: dict[str, Any] | None
