"""`/api/audit`: the audit trail, newest first."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery, QueryParameter
from sqlmodel import Session

from app.audit import service
from app.audit.schemas import AuditRead


class AuditController(Controller):
    path = "/api/audit"
    tags = ["audit"]
    # Viewers and up: app/main.py mounts it behind the viewer guard (the audit domain sits below auth, whose
    # service writes audit rows).

    @get("/", operation_id="listAudit", sync_to_thread=True)
    def list_audit(
        self,
        db_session: NamedDependency[Session],
        limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 100,
        target: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        actor: FromQuery[str | None] = None,
        before: FromQuery[int | None] = None,
    ) -> list[AuditRead]:
        """Who changed what and when, with the state before and after, newest first; filter by `target`
        (`profile:<name>`, `operator:<name>`, `token:<id>`), `action` (or a family: `decision` is every
        `decision.*`) and `actor`; `before` (a row's id) pages on to older rows."""
        return [
            AuditRead(
                id=row.id,
                at=row.at,
                actor=row.actor,
                action=row.action,
                target=row.target,
                before=row.before,
                after=row.after,
                request_id=row.request_id,
            )
            for row in service.recent(db_session, limit, target, action, actor, before)
        ]
