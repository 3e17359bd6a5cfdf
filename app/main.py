"""The console's Litestar application."""

from __future__ import annotations

import sqlite3

import structlog
from litestar import Litestar, get
from litestar.exceptions import ServiceUnavailableException

from app.settings import Settings, load_settings

log = structlog.get_logger(__name__)


def create_app(settings: Settings | None = None) -> Litestar:
    settings = settings or load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)

    @get("/healthz", sync_to_thread=False)
    def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @get("/readyz", sync_to_thread=False)
    def readyz() -> dict[str, str]:
        """The database answers."""
        try:
            with sqlite3.connect(settings.database_path, timeout=2) as conn:
                conn.execute("select 1")
        except sqlite3.Error as exc:
            raise ServiceUnavailableException(detail=f"database unreachable: {exc}") from exc
        return {"status": "ready"}

    return Litestar(route_handlers=[healthz, readyz])
