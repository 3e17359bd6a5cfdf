"""The console's audit page."""

from __future__ import annotations

from urllib.parse import urlencode

from litestar import Controller, get
from litestar.di import NamedDependency
from litestar.params import FromQuery
from litestar.response import Template
from sqlmodel import Session

from app.audit import service

PAGE_ROWS = 50


class AuditPages(Controller):
    # Viewers and up: app/main.py mounts it behind the viewer guard (the audit domain sits below auth, whose
    # service writes audit rows).

    @get("/audit", sync_to_thread=True)
    def audit_page(
        self,
        db_session: NamedDependency[Session],
        target: FromQuery[str | None] = None,
        action: FromQuery[str | None] = None,
        actor: FromQuery[str | None] = None,
        before: FromQuery[int | None] = None,
    ) -> Template:
        # One row past the page says whether an older page exists.
        rows = service.recent(db_session, PAGE_ROWS + 1, target, action, actor, before)
        filters = {"target": target or "", "action": action or "", "actor": actor or ""}
        context = {
            "rows": rows[:PAGE_ROWS],
            "filters": filters,
            "older": (
                f"/audit?{urlencode({**{k: v for k, v in filters.items() if v}, 'before': rows[PAGE_ROWS - 1].id})}"
                if len(rows) > PAGE_ROWS
                else None
            ),
            "paged": before is not None,
        }
        return Template("audit.html", context=context)
