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
