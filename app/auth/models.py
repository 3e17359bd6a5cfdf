"""Operators, their roles, and the tokens they sign in and call the API with (stored as sha256, never in clear)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from sqlmodel import Field, SQLModel

from app.db import UTCDateTime, utcnow


class Role(StrEnum):
    viewer = "viewer"
    operator = "operator"
    admin = "admin"

    @property
    def rank(self) -> int:
        return list(Role).index(self)


class TokenKind(StrEnum):
    api = "api"
    # A console sign-in: the same kind of secret, carried in a cookie and short-lived.
    session = "session"


class Operator(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    name: str = Field(unique=True)
    role: Role
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    created_by: str


class Token(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    operator_id: int = Field(foreign_key="operator.id", index=True)
    name: str
    kind: TokenKind
    token_sha256: str = Field(unique=True)
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
    expires_at: datetime | None = Field(default=None, sa_type=UTCDateTime)
    revoked_at: datetime | None = Field(default=None, sa_type=UTCDateTime)


class Secret(SQLModel, table=True):
    """Appliance secrets that must survive a restart: the CSRF signing key, the pending setup token's hash."""

    name: str = Field(primary_key=True)
    value: str
    created_at: datetime = Field(default_factory=utcnow, sa_type=UTCDateTime)
