"""Structured logs for the console: a readable renderer on a terminal, JSON lines otherwise (containers, CI), and a
request id on every line a request causes."""

from __future__ import annotations

import logging
import re
import sys
import time
import uuid

import structlog
from litestar.datastructures import Headers, MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send

REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_access_log = structlog.get_logger("app.access")


def configure_logging(json: bool | None = None, level: int = logging.INFO) -> None:
    """Set up structlog and the stdlib root logger once; `json=None` picks JSON unless stderr is a TTY."""
    use_json = (not sys.stderr.isatty()) if json is None else json
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_logger_name,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.make_filtering_bound_logger(level),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer], foreign_pre_chain=shared
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO: the supervisor's /health poll alone was most of the log.
    logging.getLogger("httpx").setLevel(max(level, logging.WARNING))


class RequestLogMiddleware(ASGIMiddleware):
    """Give each request an id (the caller's `X-Request-ID` when it is sane), bind it to every log line and audit
    row of the request, return it as `X-Request-ID`, and log one line per request."""

    scopes = (ScopeType.HTTP,)

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        headers = Headers.from_scope(scope)
        incoming = headers.get("x-request-id", "")
        request_id = incoming if REQUEST_ID_RE.fullmatch(incoming) else uuid.uuid4().hex
        structlog.contextvars.clear_contextvars()
        structlog.contextvars.bind_contextvars(request_id=request_id)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                MutableScopeHeaders.from_message(message)["x-request-id"] = request_id
            await send(message)

        # An open page's htmx polling asks every second or two; a line each would bury everything else.
        polled = scope["method"] == "GET" and headers.get("hx-request") == "true"
        try:
            await next_app(scope, receive, send_with_id)
        finally:
            (_access_log.debug if polled and status < 400 else _access_log.info)(
                "request",
                method=scope["method"],
                path=scope["path"],
                status=status,
                duration_ms=round((time.perf_counter() - started) * 1000, 1),
            )
            structlog.contextvars.clear_contextvars()
