"""Recording and reading the audit trail."""

from __future__ import annotations

from typing import Any

import structlog
from sqlmodel import Session, col, select

from app.audit.models import Audit


def record(
    session: Session,
    actor: str,
    action: str,
    target: str,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
) -> Audit:
    """Add an audit row to the caller's transaction, so the change and its record commit (or fail) together."""
    row = Audit(
        actor=actor,
        action=action,
        target=target,
        before=before,
        after=after,
        request_id=structlog.contextvars.get_contextvars().get("request_id"),
    )
    session.add(row)
    return row


def recent(session: Session, limit: int, target: str | None = None, action: str | None = None) -> list[Audit]:
    query = select(Audit).order_by(col(Audit.id).desc()).limit(limit)
    if target is not None:
        query = query.where(Audit.target == target)
    if action is not None:
        query = query.where(Audit.action == action)
    return list(session.exec(query))
