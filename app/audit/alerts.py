"""Alerts: what an operator must see, raised in the same transaction as the audit row of what happened (by the
production watch, a qualification run that could not restore what it displaced, a switch that failed), listed on
the dashboard and the route page until acknowledged."""

from __future__ import annotations

from litestar.exceptions import NotFoundException
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.audit.models import Alert, AlertLevel
from app.audit.schemas import AlertRead
from app.db import utcnow


def raise_alert(session: Session, level: AlertLevel, profile: str | None, message: str) -> None:
    """Add an alert to the caller's transaction (beside the audit row of what happened)."""
    session.add(Alert(level=level, profile=profile, message=message))


def read_alert(alert: Alert) -> AlertRead:
    return AlertRead(
        id=alert.id,
        at=alert.at,
        level=alert.level,
        profile=alert.profile,
        message=alert.message,
        acknowledged_at=alert.acknowledged_at,
        acknowledged_by=alert.acknowledged_by,
    )


def alerts(session: Session, include_acknowledged: bool = False, limit: int = 50) -> list[AlertRead]:
    query = select(Alert).order_by(col(Alert.id).desc()).limit(limit)
    if not include_acknowledged:
        query = query.where(col(Alert.acknowledged_at).is_(None))
    return [read_alert(a) for a in session.exec(query)]


def acknowledge(session: Session, actor: str, alert_id: int) -> AlertRead:
    alert = session.get(Alert, alert_id)
    if alert is None:
        raise NotFoundException(f"no alert with id {alert_id}")
    if alert.acknowledged_at is None:
        alert.acknowledged_at, alert.acknowledged_by = utcnow(), actor
        audit.record(session, actor, "alert.acknowledge", f"alert:{alert_id}", after={"message": alert.message})
        session.commit()
    return read_alert(alert)
