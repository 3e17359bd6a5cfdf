"""Console sign-in, sign-out and first-start setup pages."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.di import NamedDependency, Provide
from litestar.exceptions import HTTPException, PermissionDeniedException
from litestar.params import FromQuery, URLEncodedBody
from litestar.response import Redirect, Template
from sqlmodel import Session

from app.auth import service
from app.auth.guards import requires_viewer
from app.auth.middleware import SESSION_COOKIE
from app.auth.throttle import AttemptLimit, client_address, provide_attempts
from app.console import SIGN_IN, safe_next


def secure_cookies(request: Request) -> bool:
    """Cookies go over TLS only when the console is reached over https: directly, or behind a TLS-terminating proxy
    whose public URL (FLASHGATE_PUBLIC_URL) is https though the console itself sees http."""
    public_url = request.app.state.settings.public_url
    return request.url.scheme == "https" or bool(public_url and public_url.startswith("https://"))


class SignInController(Controller):
    dependencies = {"attempts": Provide(provide_attempts, sync_to_thread=False)}

    @get(SIGN_IN, sync_to_thread=False)
    def sign_in_page(self, next: FromQuery[str | None] = None, setup: FromQuery[str | None] = None) -> Template:
        context = {"next": safe_next(next), "error": None, "name": "", "setup_done": setup == "done"}
        return Template("signin.html", context=context)

    @post(SIGN_IN, sync_to_thread=True)
    def sign_in(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        attempts: NamedDependency[AttemptLimit],
        data: URLEncodedBody[dict[str, str]],
    ) -> Response:
        name, target = data.get("name", "").strip(), safe_next(data.get("next"))
        client = client_address(request)
        try:
            attempts.check(client)
            try:
                secret = service.sign_in(db_session, name, data.get("token", "").strip(), client)
            except HTTPException:
                attempts.failed(client)
                raise
        except HTTPException as exc:
            return Template(
                "signin.html",
                context={"next": target, "error": exc.detail, "name": name, "setup_done": False},
                status_code=exc.status_code,
                headers=exc.headers,
            )
        cookie = Cookie(
            key=SESSION_COOKIE,
            value=secret,
            httponly=True,
            samesite="lax",
            secure=secure_cookies(request),
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
            # Said on the sign-in page, not a silent bounce back to it.
            return Redirect(f"{SIGN_IN}?setup=done")
        return Template("setup.html", context={"error": None, "name": "admin", "issued": None})

    @post("/setup", sync_to_thread=True)
    def setup(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        attempts: NamedDependency[AttemptLimit],
        data: URLEncodedBody[dict[str, str]],
    ) -> Template:
        """Exchange the setup token from the first start's log for the admin account; the new token is shown once."""
        name = data.get("name", "").strip()
        client = client_address(request)
        try:
            attempts.check(client)
            try:
                operator, _, secret = service.exchange_setup_token(
                    db_session, data.get("setup_token", "").strip(), name
                )
            except PermissionDeniedException:
                attempts.failed(client)
                raise
        except HTTPException as exc:
            return Template(
                "setup.html",
                context={"error": exc.detail, "name": name, "issued": None},
                status_code=exc.status_code,
                headers=exc.headers,
            )
        return Template("setup.html", context={"error": None, "name": operator.name, "issued": secret})
