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


class WaiverCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    gate: str
    reason: str = ""


class DecisionCreate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`promote`, `no_promotion` or `reject`, on a run (by default the profile's latest finished run). A promotion
    needs `confirm` to be the profile's name, and a waiver with a reason for each failed gate."""

    decision: str
    reason: str = ""
    confirm: str = ""
    waivers: list[WaiverCreate] = msgspec.field(default_factory=list)
    run: int | None = None


class WaiverRead(msgspec.Struct):
    gate: str
    reason: str
    operator: str
    created_at: datetime


class DecisionRead(msgspec.Struct, kw_only=True):
    id: int
    profile: str
    run: int
    decision: str
    reason: str
    operator: str
    content_hash: str
    created_at: datetime
    waivers: list[WaiverRead]
    # The switch a promotion decision started.
    promotion: int | None = None


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
