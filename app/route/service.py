"""Agent keys (a high-entropy secret shown once, stored as sha256, named, revocable), the route's usage per caller
and profile. Keys are not operator tokens: each works on its own side only."""

from __future__ import annotations

import bisect
import hashlib
import secrets
import threading
from dataclasses import dataclass, field
from datetime import datetime

from litestar.exceptions import NotFoundException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.db import utcnow, writing
from app.errors import Conflict, InvalidFields, name_errors
from app.route.models import LATENCY_BUCKETS_S, AgentKey, RouteUsage
from app.route.schemas import KeyRead, UsageRead

# Operator tokens start with "fg_"; a key in a log or a secret scanner says which kind it is.
KEY_PREFIX = "fg-"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def key_target(name: str) -> str:
    return f"key:{name}"


# Keys


def live_key(session: Session, name: str) -> AgentKey | None:
    return session.exec(select(AgentKey).where(AgentKey.name == name, col(AgentKey.revoked_at).is_(None))).first()


def read_key(key: AgentKey, usage: dict[int, tuple[int, int]]) -> KeyRead:
    requests, errors = usage.get(key.id, (0, 0))
    return KeyRead(
        name=key.name,
        created_at=key.created_at,
        created_by=key.created_by,
        last_used_at=key.last_used_at,
        revoked_at=key.revoked_at,
        revoked_by=key.revoked_by,
        requests=requests,
        errors=errors,
    )


def create_key(session: Session, actor: str, name: str) -> tuple[AgentKey, str]:
    if errors := name_errors(name):
        raise InvalidFields(errors)
    if live_key(session, name) is not None:
        raise Conflict(f"a key named {name!r} exists already: revoke it first, or pick another name")
    secret = KEY_PREFIX + secrets.token_urlsafe(32)
    key = AgentKey(name=name, key_sha256=digest(secret), created_by=actor)
    session.add(key)
    session.flush()
    audit.record(session, actor, "key.create", key_target(name), after={"id": key.id})
    session.commit()
    return key, secret


def revoke_key(session: Session, actor: str, name: str) -> None:
    key = live_key(session, name)
    if key is None:
        raise NotFoundException(f"no live key named {name!r}")
    key.revoked_at, key.revoked_by = utcnow(), actor
    audit.record(session, actor, "key.revoke", key_target(name), before={"id": key.id}, after={"revoked": True})
    session.commit()


def list_keys(session: Session) -> list[KeyRead]:
    """Live keys first, then revoked ones, newest first within each."""
    usage: dict[int, tuple[int, int]] = {}
    for row in session.exec(select(RouteUsage).where(col(RouteUsage.key_id).is_not(None))):
        requests, errors = usage.get(row.key_id, (0, 0))
        usage[row.key_id] = (requests + row.requests, errors + row.errors)
    keys = session.exec(select(AgentKey).order_by(col(AgentKey.id).desc())).all()
    return [read_key(k, usage) for k in sorted(keys, key=lambda k: k.revoked_at is not None)]


def key_for_secret(db: Engine, secret: str) -> AgentKey | None:
    with Session(db) as session:
        key = session.exec(select(AgentKey).where(AgentKey.key_sha256 == digest(secret))).first()
    return key if key is not None and key.revoked_at is None else None


# Usage


@dataclass
class _Tally:
    requests: int = 0
    errors: int = 0
    latency_sum_s: float = 0.0
    latency_max_s: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    last_at: datetime = field(default_factory=utcnow)


class UsageBook:
    """Requests through the route, tallied in memory as they end and written in one transaction every few seconds
    and before any read. A write per request would make every agent request contend for SQLite's one writer with
    the console's state changes."""

    def __init__(self, db: Engine) -> None:
        self.db = db
        self._lock = threading.Lock()
        self._pending: dict[tuple[int | None, str, str], _Tally] = {}

    def add(self, key_id: int | None, caller: str, profile: str, ok: bool, seconds: float) -> None:
        with self._lock:
            tally = self._pending.setdefault((key_id, caller, profile), _Tally())
            tally.requests += 1
            tally.errors += 0 if ok else 1
            tally.latency_sum_s += seconds
            tally.latency_max_s = max(tally.latency_max_s, seconds)
            tally.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            tally.last_at = utcnow()

    def flush(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        with writing(self.db) as session:
            for (key_id, caller, profile), tally in pending.items():
                row = session.exec(
                    select(RouteUsage).where(
                        RouteUsage.key_id == key_id if key_id is not None else col(RouteUsage.key_id).is_(None),
                        RouteUsage.caller == caller,
                        RouteUsage.profile == profile,
                    )
                ).first()
                if row is None:
                    row = RouteUsage(key_id=key_id, caller=caller, profile=profile)
                    session.add(row)
                row.requests += tally.requests
                row.errors += tally.errors
                row.latency_sum_s += tally.latency_sum_s
                row.latency_max_s = max(row.latency_max_s, tally.latency_max_s)
                row.latency_buckets = [a + b for a, b in zip(row.latency_buckets, tally.buckets, strict=True)]
                row.last_at = tally.last_at
                if key_id is not None:
                    key = session.get(AgentKey, key_id)
                    key.last_used_at = max(key.last_used_at or tally.last_at, tally.last_at)
            session.commit()


def _quantile(buckets: list[int], q: float) -> float | None:
    total, seen = sum(buckets), 0
    for bound, count in zip((*LATENCY_BUCKETS_S, None), buckets, strict=True):
        seen += count
        if seen >= q * total:
            return bound
    return None


def _bound(bucket: float | None, slowest: float) -> float:
    """A quantile is at most its histogram bucket's bound and at most the slowest request: the tighter says more
    ("p95 ≤ 1 s" beside "max 0.67 s" says nothing)."""
    return slowest if bucket is None else min(bucket, slowest)


def _usage(name: str, rows: list[RouteUsage]) -> UsageRead:
    requests = sum(r.requests for r in rows)
    slowest = round(max((r.latency_max_s for r in rows), default=0.0), 3)
    buckets = [sum(column) for column in zip(*(r.latency_buckets for r in rows), strict=True)]
    return UsageRead(
        name=name,
        requests=requests,
        errors=sum(r.errors for r in rows),
        mean_s=round(sum(r.latency_sum_s for r in rows) / requests, 3) if requests else None,
        p50_le_s=_bound(_quantile(buckets, 0.5), slowest) if requests else None,
        p95_le_s=_bound(_quantile(buckets, 0.95), slowest) if requests else None,
        max_s=slowest,
        last_at=max(r.last_at for r in rows) if rows else None,
    )


def usage(session: Session) -> tuple[list[UsageRead], list[UsageRead]]:
    """Per key (and per console caller), and per profile; busiest first."""
    rows = session.exec(select(RouteUsage)).all()
    by_key: dict[str, list[RouteUsage]] = {}
    by_profile: dict[str, list[RouteUsage]] = {}
    for row in rows:
        by_key.setdefault(row.caller, []).append(row)
        by_profile.setdefault(row.profile or "(none)", []).append(row)

    def ordered(groups: dict[str, list[RouteUsage]]) -> list[UsageRead]:
        return sorted((_usage(name, group) for name, group in groups.items()), key=lambda u: (-u.requests, u.name))

    return ordered(by_key), ordered(by_profile)
