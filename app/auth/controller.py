"""`/api/operators`, `/api/tokens`, `/api/setup`: operator accounts and their API tokens."""

from __future__ import annotations

import msgspec
from litestar import Controller, Request, delete, get, post
from litestar.di import NamedDependency, Provide
from litestar.exceptions import PermissionDeniedException
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_201_CREATED, HTTP_204_NO_CONTENT
from sqlmodel import Session

from app.auth import service
from app.auth.guards import requires_admin, requires_viewer
from app.auth.models import Operator, Token
from app.auth.schemas import (
    IssuedToken,
    OperatorCreate,
    OperatorCreated,
    OperatorRead,
    SetupExchange,
    TokenCreate,
    TokenRead,
)
from app.auth.throttle import AttemptLimit, client_address, provide_attempts


def _issued(token: Token, operator: Operator, secret: str) -> IssuedToken:
    return IssuedToken(**msgspec.structs.asdict(TokenRead.of(token, operator)), secret=secret)


def _operator_read(operator: Operator, tokens: list[Token]) -> OperatorRead:
    return OperatorRead(
        name=operator.name,
        role=operator.role,
        created_at=operator.created_at,
        created_by=operator.created_by,
        tokens=[TokenRead.of(t, operator) for t in tokens],
    )


class OperatorController(Controller):
    path = "/api"
    tags = ["operators"]

    @get("/operators", guards=[requires_admin], operation_id="listOperators", sync_to_thread=True)
    def list_operators(self, db_session: NamedDependency[Session]) -> list[OperatorRead]:
        """Every operator with their tokens (never the secrets)."""
        return [_operator_read(o, tokens) for o, tokens in service.list_operators(db_session)]

    @post(
        "/operators",
        guards=[requires_admin],
        operation_id="createOperator",
        status_code=HTTP_201_CREATED,
        sync_to_thread=True,
    )
    def create_operator(
        self, request: Request, db_session: NamedDependency[Session], data: JSONBody[OperatorCreate]
    ) -> OperatorCreated:
        """Create an operator with a role and a first API token; the token's secret is in this response only."""
        operator, token, secret = service.create_operator(
            db_session, request.user, data.name, data.role, data.token_name
        )
        return OperatorCreated(operator=_operator_read(operator, [token]), token=_issued(token, operator, secret))

    @post(
        "/operators/{name:str}/tokens",
        guards=[requires_viewer],
        operation_id="createToken",
        status_code=HTTP_201_CREATED,
        sync_to_thread=True,
    )
    def create_token(
        self, request: Request, db_session: NamedDependency[Session], name: FromPath[str], data: JSONBody[TokenCreate]
    ) -> IssuedToken:
        """Issue another API token to an operator (an admin for anyone, an operator for themselves)."""
        token, secret = service.create_token(db_session, request.user, name, data.name)
        return _issued(token, db_session.get(Operator, token.operator_id), secret)

    @delete(
        "/tokens/{token_id:int}",
        guards=[requires_viewer],
        operation_id="revokeToken",
        status_code=HTTP_204_NO_CONTENT,
        sync_to_thread=True,
    )
    def revoke_token(self, request: Request, db_session: NamedDependency[Session], token_id: FromPath[int]) -> None:
        """Revoke a token (an admin any, an operator their own); it stops working at once."""
        service.revoke_token(db_session, request.user, token_id)

    @post(
        "/setup",
        operation_id="exchangeSetupToken",
        status_code=HTTP_201_CREATED,
        sync_to_thread=True,
        dependencies={"attempts": Provide(provide_attempts, sync_to_thread=False)},
    )
    def exchange_setup_token(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        attempts: NamedDependency[AttemptLimit],
        data: JSONBody[SetupExchange],
    ) -> OperatorCreated:
        """Trade the one-time setup token printed at first start for the first admin account. 429 with
        `Retry-After` after too many wrong setup tokens or sign-ins from one address."""
        client = client_address(request)
        attempts.check(client)
        try:
            operator, token, secret = service.exchange_setup_token(db_session, data.setup_token, data.name)
        except PermissionDeniedException:
            attempts.failed(client)
            raise
        return OperatorCreated(operator=_operator_read(operator, [token]), token=_issued(token, operator, secret))
