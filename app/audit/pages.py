"""The console's audit page."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template
from sqlmodel import Session

from app.audit import service
from app.auth.guards import requires_viewer


class AuditPages(Controller):
    guards = [requires_viewer]

    @get("/audit", sync_to_thread=True)
    def audit_page(self, db_session: NamedDependency[Session], target: FromQuery[str | None] = None) -> Template:
        return Template("audit.html", context={"rows": service.recent(db_session, 200, target), "target": target})
