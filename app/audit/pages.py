"""The console's audit page."""

from __future__ import annotations

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template
from sqlmodel import Session

from app.audit import service


class AuditPages(Controller):
    # Viewers and up: app/main.py mounts it behind the viewer guard (the audit domain sits below auth, whose
    # service writes audit rows).

    @get("/audit", sync_to_thread=True)
    def audit_page(self, db_session: NamedDependency[Session], target: FromQuery[str | None] = None) -> Template:
        return Template("audit.html", context={"rows": service.recent(db_session, 200, target), "target": target})
