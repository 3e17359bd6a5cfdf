"""What every console page shares: the router they live on and how errors show on a page rather than as JSON."""

from __future__ import annotations

from urllib.parse import quote

from litestar import Response, Router
from litestar.exceptions import HTTPException, NotAuthorizedException
from litestar.plugins.htmx import ClientRedirect, HTMXRequest
from litestar.response import Redirect, Template
from litestar.types import ControllerRouterHandler

SIGN_IN = "/signin"


def safe_next(target: str | None) -> str:
    """Only a local path may follow sign-in, never another site."""
    return target if target and target.startswith("/") and not target.startswith("//") else "/dashboard"


def redirect(request: HTMXRequest, target: str) -> Response:
    """After a form post: htmx follows a client redirect, a plain form a 303."""
    return ClientRedirect(target) if request.htmx else Redirect(target, status_code=303)


def console_error(request: HTMXRequest, exc: HTTPException) -> Response:
    if isinstance(exc, NotAuthorizedException):
        return redirect(request, f"{SIGN_IN}?next={quote(request.url.path)}")
    context = {"status_code": exc.status_code, "detail": exc.detail}
    if request.htmx:
        # Shown in the page's notice area, whatever element the request meant to update.
        return Template(
            "_notice.html",
            context=context,
            status_code=exc.status_code,
            headers={"HX-Retarget": "#notice", "HX-Reswap": "innerHTML"},
        )
    return Template("error.html", context=context, status_code=exc.status_code)


def console_router(handlers: list[ControllerRouterHandler]) -> Router:
    return Router(
        path="/",
        route_handlers=handlers,
        exception_handlers={HTTPException: console_error},
        include_in_schema=False,
    )
