from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


class AuditRead(msgspec.Struct):
    id: int
    at: datetime
    actor: str
    action: str
    target: str
    before: dict[str, Any] | None
    after: dict[str, Any] | None
    request_id: str | None


class AlertRead(msgspec.Struct, kw_only=True):
    id: int
    at: datetime
    level: str
    profile: str | None
    message: str
    acknowledged_at: datetime | None
    acknowledged_by: str | None
