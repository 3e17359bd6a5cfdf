from __future__ import annotations

from datetime import datetime

import msgspec


class PromotionRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`PUT /api/route/production`: switch to a profile an operator approved (a `promote` decision on a current
    run). `dry_run` only shows the plan."""

    profile: str
    reason: str = ""
    dry_run: bool = False


class RollbackRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    reason: str = ""
    dry_run: bool = False


class StepRead(msgspec.Struct):
    step: str
    status: str
    at: datetime
    detail: str


class PromotionRead(msgspec.Struct, kw_only=True):
    id: int
    kind: str
    target: str
    previous: str | None
    restore: str | None
    decision: int | None
    reason: str
    status: str
    steps: list[StepRead]
    started_at: datetime
    started_by: str
    finished_at: datetime | None
    downtime_s: float | None
    error: str | None


class CheckRead(msgspec.Struct):
    name: str
    status: str
    detail: str


class StartabilityRead(msgspec.Struct):
    """Whether a profile can start right now (the supervisor's own preflight of the profile and its weights)."""

    profile: str
    can_start: bool
    reasons: list[str]
    checks: list[CheckRead]


class PlanRead(msgspec.Struct, kw_only=True):
    """A dry run: what stops, what starts, what is restored if the start fails, and whether it would be allowed."""

    kind: str
    target: str
    stops: str | None
    starts: StartabilityRead
    rollback: StartabilityRead | None
    allowed: bool
    # Why the switch would be refused now (409 or 423 reasons), empty when allowed.
    refusals: list[str]
    qualifying_run: int | None
    decision: int | None


class RouteRead(msgspec.Struct, kw_only=True):
    production: str | None
    rollback: StartabilityRead | None
    challengers: list[str]
    rejected: list[str]
    updated_at: datetime | None
    updated_by: str | None
    # The switch running now, if any, and the latest ones.
    transaction: PromotionRead | None
    recent: list[PromotionRead]
    locked_by: str | None
