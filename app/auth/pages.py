"""Console sign-in, sign-out and first-start setup pages."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from litestar.params import FromQuery, URLEncodedBody
from litestar.response import Redirect, Template
from sqlmodel import Session

from app.auth import service
from app.auth.guards import requires_viewer
from app.auth.middleware import SESSION_COOKIE
from app.console import SIGN_IN, safe_next


class SignInController(Controller):
    @get(SIGN_IN, sync_to_thread=False)
    def sign_in_page(self, next: FromQuery[str | None] = None) -> Template:
        return Template("signin.html", context={"next": safe_next(next), "error": None, "name": ""})

    @post(SIGN_IN, sync_to_thread=True)
    def sign_in(
        self, request: Request, db_session: NamedDependency[Session], data: URLEncodedBody[dict[str, str]]
    ) -> Response:
        name, target = data.get("name", "").strip(), safe_next(data.get("next"))
        try:
            secret = service.sign_in(db_session, name, data.get("token", "").strip())
        except HTTPException as exc:
            return Template(
                "signin.html", context={"next": target, "error": exc.detail, "name": name}, status_code=exc.status_code
            )
        cookie = Cookie(
            key=SESSION_COOKIE,
            value=secret,
            httponly=True,
            samesite="lax",
            secure=request.url.scheme == "https",
            max_age=int(service.SESSION_LIFETIME.total_seconds()),
        )
        return Redirect(target, status_code=303, cookies=[cookie])

    @post("/signout", guards=[requires_viewer], sync_to_thread=True)
    def sign_out(self, request: Request, db_session: NamedDependency[Session]) -> Redirect:
        service.sign_out(db_session, request.user)
        response = Redirect(SIGN_IN, status_code=303)
        response.delete_cookie(SESSION_COOKIE)
        return response

    @get("/setup", sync_to_thread=True)
    def setup_page(self, db_session: NamedDependency[Session]) -> Response:
        if not service.setup_pending(db_session):
            return Redirect(SIGN_IN)
        return Template("setup.html", context={"error": None, "name": "admin", "issued": None})

    @post("/setup", sync_to_thread=True)
    def setup(self, db_session: NamedDependency[Session], data: URLEncodedBody[dict[str, str]]) -> Template:
        """Exchange the setup token from the first start's log for the admin account; the new token is shown once."""
        name = data.get("name", "").strip()
        try:
            operator, _, secret = service.exchange_setup_token(db_session, data.get("setup_token", "").strip(), name)
        except HTTPException as exc:
            return Template(
                "setup.html", context={"error": exc.detail, "name": name, "issued": None}, status_code=exc.status_code
            )
        return Template("setup.html", context={"error": None, "name": operator.name, "issued": secret})
