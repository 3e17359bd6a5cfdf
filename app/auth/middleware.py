"""Who is calling: `/api` reads a bearer token, console pages read the session cookie. A cookie never
authenticates an API call, which is why `/api` can be exempt from CSRF checks. The agent route (`/v1`) is no
operator's: it checks agent keys itself, and neither operator tokens nor cookies count there."""

from __future__ import annotations

import anyio.to_thread
import structlog
from litestar.connection import ASGIConnection
from litestar.datastructures import MutableScopeHeaders
from litestar.enums import ScopeType
from litestar.middleware import ASGIMiddleware
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from sqlalchemy import Engine

from app.auth.models import TokenKind
from app.auth.service import Principal, authenticate

SESSION_COOKIE = "flashgate_session"
API_PREFIX = "/api/"
ROUTE_PREFIX = "/v1/"


def _credentials(scope: Scope) -> tuple[str, TokenKind] | None:
    connection = ASGIConnection(scope)
    if scope["path"].startswith(ROUTE_PREFIX):
        return None
    if scope["path"].startswith(API_PREFIX):
        scheme, _, secret = connection.headers.get("authorization", "").partition(" ")
        return (secret.strip(), TokenKind.api) if scheme.lower() == "bearer" and secret.strip() else None
    secret = connection.cookies.get(SESSION_COOKIE)
    return (secret, TokenKind.session) if secret else None


class AuthenticationMiddleware(ASGIMiddleware):
    scopes = (ScopeType.HTTP,)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def handle(self, scope: Scope, receive: Receive, send: Send, next_app: ASGIApp) -> None:
        principal: Principal | None = None
        if (credentials := _credentials(scope)) is not None:
            principal = await anyio.to_thread.run_sync(authenticate, self.engine, *credentials)
        scope["user"] = principal
        scope["auth"] = credentials[1] if principal and credentials else None
        if principal is not None:
            structlog.contextvars.bind_contextvars(operator=principal.name)
        await next_app(scope, receive, send)


# Never inside another site's frame (clickjacking a Stop or a promotion); no type sniffing; no URL leaks in Referer.
SECURITY_HEADERS = {
    "x-frame-options": "DENY",
    "content-security-policy": "frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}


async def security_headers(message: Message, scope: Scope) -> None:
    """A `before_send` hook: every answer carries them, router 404s, errors and static files included."""
    if message["type"] == "http.response.start":
        headers = MutableScopeHeaders.from_message(message)
        for name, value in SECURITY_HEADERS.items():
            if name not in headers:
                headers[name] = value
