"""Operators and tokens: bootstrap of the first admin, sign-in, API tokens, revocation. Secrets are shown once and
stored only as sha256."""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from datetime import timedelta
from hmac import compare_digest

import structlog
from litestar.exceptions import NotAuthorizedException, NotFoundException, PermissionDeniedException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.auth.models import Operator, Role, Secret, Token, TokenKind
from app.db import lock_for_write, utcnow
from app.errors import Conflict, InvalidFields, name_errors

log = structlog.get_logger(__name__)

SESSION_LIFETIME = timedelta(hours=12)
ENV_ADMIN = "admin"
ENV_TOKEN_NAME = "FLASHGATE_ADMIN_TOKEN"
SETUP_SECRET = "setup_token_sha256"
CSRF_SECRET = "csrf"


@dataclass(frozen=True)
class Principal:
    """Who a request comes from; `request.user` holds one, or None for anonymous requests."""

    operator_id: int
    name: str
    role: Role
    token_id: int

    def allows(self, role: Role | str) -> bool:
        return self.role.rank >= Role(role).rank


def new_secret() -> str:
    # The prefix makes a leaked token recognisable in logs and secret scanners.
    return "fg_" + secrets.token_urlsafe(32)


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def _is_live(token: Token) -> bool:
    return token.revoked_at is None and (token.expires_at is None or token.expires_at > utcnow())


def authenticate(engine: Engine, secret: str, kind: TokenKind) -> Principal | None:
    with Session(engine) as session:
        row = session.exec(
            select(Token, Operator)
            .join(Operator, col(Operator.id) == Token.operator_id)
            .where(Token.token_sha256 == digest(secret), Token.kind == kind)
        ).first()
    if row is None or not _is_live(row[0]):
        return None
    token, operator = row
    return Principal(operator_id=operator.id, name=operator.name, role=operator.role, token_id=token.id)


def appliance_secret(session: Session, name: str) -> str:
    """A random secret made once per data directory (the CSRF signing key), so forms survive a restart."""
    row = session.get(Secret, name)
    if row is None:
        row = Secret(name=name, value=secrets.token_hex(32))
        session.add(row)
        session.commit()
    return row.value


def _operator(session: Session, name: str) -> Operator:
    operator = session.exec(select(Operator).where(Operator.name == name)).first()
    if operator is None:
        raise NotFoundException(f"no operator named {name!r}")
    return operator


def _issue(session: Session, operator: Operator, name: str, kind: TokenKind) -> tuple[Token, str]:
    secret = new_secret()
    token = Token(
        operator_id=operator.id,
        name=name,
        kind=kind,
        token_sha256=digest(secret),
        expires_at=utcnow() + SESSION_LIFETIME if kind is TokenKind.session else None,
    )
    session.add(token)
    session.flush()
    return token, secret


def _token_audit(token: Token, operator: Operator) -> dict:
    return {"id": token.id, "name": token.name, "kind": token.kind, "operator": operator.name}


def bootstrap_admin(session: Session, admin_token: str | None) -> str | None:
    """Make sure someone can become admin. With FLASHGATE_ADMIN_TOKEN that is the operator `admin` holding that
    token; otherwise a one-time setup token, returned here (to be logged once) and exchanged for the admin account."""
    if admin_token:
        operator = session.exec(select(Operator).where(Operator.name == ENV_ADMIN)).first()
        if operator is None:
            operator = Operator(name=ENV_ADMIN, role=Role.admin, created_by="system")
            session.add(operator)
            session.flush()
            audit.record(session, "system", "operator.create", f"operator:{ENV_ADMIN}", after={"role": Role.admin})
        tokens = session.exec(select(Token).where(Token.operator_id == operator.id, Token.name == ENV_TOKEN_NAME))
        live = [t for t in tokens if t.revoked_at is None]
        if not any(t.token_sha256 == digest(admin_token) for t in live):
            # The variable changed (or was revoked through the API): the environment is the source of truth.
            for old in live:
                old.revoked_at = utcnow()
                audit.record(session, "system", "token.revoke", f"token:{old.id}", before=_token_audit(old, operator))
            token = Token(
                operator_id=operator.id, name=ENV_TOKEN_NAME, kind=TokenKind.api, token_sha256=digest(admin_token)
            )
            session.add(token)
            session.flush()
            audit.record(session, "system", "token.create", f"token:{token.id}", after=_token_audit(token, operator))
        if (pending := session.get(Secret, SETUP_SECRET)) is not None:
            session.delete(pending)
        session.commit()
        return None
    if session.exec(select(Operator).where(Operator.role == Role.admin)).first() is not None:
        return None
    if session.get(Secret, SETUP_SECRET) is not None:
        log.warning("setup_pending", hint="use the setup token logged at first start, or set FLASHGATE_ADMIN_TOKEN")
        return None
    setup_token = new_secret()
    session.add(Secret(name=SETUP_SECRET, value=digest(setup_token)))
    audit.record(session, "system", "setup.token_issued", "setup")
    session.commit()
    return setup_token


def setup_pending(session: Session) -> bool:
    return session.get(Secret, SETUP_SECRET) is not None


def exchange_setup_token(session: Session, setup_token: str, name: str) -> tuple[Operator, Token, str]:
    """Trade the one-time setup token for the first admin account and its API token."""
    pending = session.get(Secret, SETUP_SECRET)
    if pending is None or not compare_digest(pending.value, digest(setup_token)):
        raise PermissionDeniedException("the setup token is wrong or has already been used")
    if errors := name_errors(name):
        raise InvalidFields(errors)
    operator = Operator(name=name, role=Role.admin, created_by="setup")
    session.add(operator)
    session.delete(pending)
    session.flush()
    token, secret = _issue(session, operator, "setup", TokenKind.api)
    audit.record(session, name, "operator.create", f"operator:{name}", after={"role": Role.admin, "via": "setup"})
    audit.record(session, name, "token.create", f"token:{token.id}", after=_token_audit(token, operator))
    session.commit()
    return operator, token, secret


def sign_in(session: Session, name: str, secret: str, client: str) -> str:
    """Check an operator's API token and open a console session; returns the session secret for the cookie. A
    failure is an audit row (who was tried, from where, why), never with the token tried; the answer says no more
    than "unknown operator or token"."""
    lock_for_write(session)  # it reads, then writes: another commit in between would fail it with "database is locked"
    operator = session.exec(select(Operator).where(Operator.name == name)).first()
    token = session.exec(select(Token).where(Token.token_sha256 == digest(secret), Token.kind == TokenKind.api)).first()
    if operator is None:
        refused = "no operator of that name"
    elif token is None or token.operator_id != operator.id:
        refused = "not a token of this operator"
    elif not _is_live(token):
        refused = "the token is revoked or expired"
    else:
        refused = None
    if refused is not None:
        audit.record(
            session,
            name or "anonymous",
            "operator.sign_in_failed",
            f"operator:{name}",
            after={"reason": refused, "client": client},
        )
        session.commit()
        raise NotAuthorizedException("unknown operator or token")
    signed_in, session_secret = _issue(session, operator, "console sign-in", TokenKind.session)
    audit.record(
        session, name, "operator.sign_in", f"operator:{name}", after={"session": signed_in.id, "client": client}
    )
    session.commit()
    return session_secret


def sign_out(session: Session, principal: Principal) -> None:
    lock_for_write(session)
    token = session.get(Token, principal.token_id)
    if token is not None and token.revoked_at is None:
        token.revoked_at = utcnow()
        audit.record(session, principal.name, "operator.sign_out", f"operator:{principal.name}")
        session.commit()


def list_operators(session: Session) -> list[tuple[Operator, list[Token]]]:
    operators = session.exec(select(Operator).order_by(Operator.name)).all()
    tokens = session.exec(select(Token).order_by(Token.id)).all()
    return [(o, [t for t in tokens if t.operator_id == o.id]) for o in operators]


def create_operator(
    session: Session, actor: Principal, name: str, role: Role, token_name: str
) -> tuple[Operator, Token, str]:
    errors = name_errors(name) + name_errors(token_name, "token_name")
    if errors:
        raise InvalidFields(errors)
    if session.exec(select(Operator).where(Operator.name == name)).first() is not None:
        raise Conflict(f"an operator named {name!r} already exists")
    operator = Operator(name=name, role=role, created_by=actor.name)
    session.add(operator)
    session.flush()
    token, secret = _issue(session, operator, token_name, TokenKind.api)
    audit.record(session, actor.name, "operator.create", f"operator:{name}", after={"role": role})
    audit.record(session, actor.name, "token.create", f"token:{token.id}", after=_token_audit(token, operator))
    session.commit()
    return operator, token, secret


def _may_manage(actor: Principal, operator_id: int) -> None:
    if actor.role is not Role.admin and actor.operator_id != operator_id:
        raise PermissionDeniedException(f"only an admin or the token's owner may do this; {actor.name} is {actor.role}")


def create_token(session: Session, actor: Principal, operator_name: str, token_name: str) -> tuple[Token, str]:
    operator = _operator(session, operator_name)
    _may_manage(actor, operator.id)
    if errors := name_errors(token_name):
        raise InvalidFields(errors)
    token, secret = _issue(session, operator, token_name, TokenKind.api)
    audit.record(session, actor.name, "token.create", f"token:{token.id}", after=_token_audit(token, operator))
    session.commit()
    return token, secret


def revoke_token(session: Session, actor: Principal, token_id: int) -> None:
    token = session.get(Token, token_id)
    if token is None:
        raise NotFoundException(f"no token with id {token_id}")
    _may_manage(actor, token.operator_id)
    if token.revoked_at is not None:
        return
    operator = session.get(Operator, token.operator_id)
    before = _token_audit(token, operator)
    token.revoked_at = utcnow()
    audit.record(session, actor.name, "token.revoke", f"token:{token.id}", before=before, after={"revoked": True})
    session.commit()
