"""Role guards: anonymous requests get 401, a signed-in operator without the role gets 403."""

from __future__ import annotations

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard

from app.auth.models import Role
from app.auth.service import Principal


def requires(role: Role) -> Guard:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:
        principal: Principal | None = connection.user
        if principal is None:
            raise NotAuthorizedException(
                "authentication required: sign in, or send 'Authorization: Bearer <token>' to /api",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not principal.allows(role):
            raise PermissionDeniedException(f"this needs the {role} role; {principal.name} is {principal.role}")

    return guard


requires_viewer = requires(Role.viewer)
requires_operator = requires(Role.operator)
requires_admin = requires(Role.admin)
