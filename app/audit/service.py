"""Recording and reading the audit trail."""

from __future__ import annotations

from typing import Any

import structlog
from sqlalchemy import or_
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


def recent(
    session: Session,
    limit: int,
    target: str | None = None,
    action: str | None = None,
    actor: str | None = None,
    before: int | None = None,
) -> list[Audit]:
    """The newest rows first; `action` matches the action or a family of them (`decision` is every
    `decision.*`); `before` pages on: only rows older than that id."""
    query = select(Audit).order_by(col(Audit.id).desc()).limit(limit)
    if target:
        query = query.where(Audit.target == target)
    if action:
        query = query.where(or_(Audit.action == action, col(Audit.action).startswith(f"{action.rstrip('.')}.")))
    if actor:
        query = query.where(Audit.actor == actor)
    if before is not None:
        query = query.where(col(Audit.id) < before)
    return list(session.exec(query))
