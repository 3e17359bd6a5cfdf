from __future__ import annotations

from datetime import datetime

import msgspec

from app.auth.models import Operator, Role, Token, TokenKind


class OperatorCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    role: Role = Role.viewer
    token_name: str = "default"


class TokenCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str


class SetupExchange(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    setup_token: str
    name: str


class TokenRead(msgspec.Struct, kw_only=True):
    id: int
    operator: str
    name: str
    kind: TokenKind
    created_at: datetime
    expires_at: datetime | None
    revoked_at: datetime | None

    @classmethod
    def of(cls, token: Token, operator: Operator) -> TokenRead:
        return cls(
            id=token.id,
            operator=operator.name,
            name=token.name,
            kind=token.kind,
            created_at=token.created_at,
            expires_at=token.expires_at,
            revoked_at=token.revoked_at,
        )


class IssuedToken(TokenRead, kw_only=True):
    """A new token with its secret: the only time the secret is shown."""

    secret: str


class OperatorRead(msgspec.Struct, kw_only=True):
    name: str
    role: Role
    created_at: datetime
    created_by: str
    tokens: list[TokenRead]


class OperatorCreated(msgspec.Struct, kw_only=True):
    operator: OperatorRead
    token: IssuedToken
