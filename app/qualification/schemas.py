from __future__ import annotations

from datetime import datetime
from typing import Any

import msgspec


class QualifyRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Start a run. When an engine is serving, the run drains, stops and later restores it: say so with
    `confirm_downtime: true`."""

    confirm_downtime: bool = False


class GateDefinitionRead(msgspec.Struct):
    name: str
    version: int
    title: str
    kind: str
    pass_rule: str
    measurements: list[str]
    needs_engine: bool


class GateRead(msgspec.Struct, kw_only=True):
    name: str
    version: int
    title: str
    kind: str
    position: int
    # pending, running, passed, failed, n/a or not_run.
    status: str
    summary: str
    pass_rule: str
    inputs: dict[str, Any]
    measurements: dict[str, Any]
    started_at: datetime | None
    finished_at: datetime | None
    seconds: float | None
    observations: int
    # The waiver an operator gave this failed gate in a promotion decision on this run, if any.
    waiver: WaiverRead | None = None


class ProgressRead(msgspec.Struct, kw_only=True):
    gate: str | None
    title: str | None
    # Gates finished so far, of `total`.
    done: int
    total: int
    step: str
    elapsed_s: float
    gate_elapsed_s: float | None


class StalenessRead(msgspec.Struct):
    stale: bool
    # What changed since the run: the profile's content, the engine build, the weights.
    reasons: list[str]


class DeltaRead(msgspec.Struct):
    metric: str
    label: str
    unit: str
    this: float | None
    baseline: float | None
    # (this − baseline) / baseline, in percent; the baseline is `against` in the comparison.
    delta_pct: float | None
    better: bool | None


class ComparisonRead(msgspec.Struct):
    # The baseline: the production profile (the rollback profile once this one holds production), and its run on
    # the same benchmark shape.
    against: str | None
    run: int | None
    comparable: bool
    note: str
    deltas: list[DeltaRead]


class ProposalRead(msgspec.Struct):
    # promote, no_promotion, reject, requalify, pending while the run goes on, or none for an aborted run (whose
    # gates not run decide nothing). A proposal only: an operator decides.
    recommendation: str
    headline: str
    reasons: list[str]
    failed_gates: list[str]
    comparison: ComparisonRead


class QualificationRead(msgspec.Struct, kw_only=True):
    id: int
    profile: str
    status: str
    ladder: str
    scale: str | None
    content_hash: str
    weights_fingerprint: str | None
    engine_build: str | None
    engine_run: int | None
    started_at: datetime
    started_by: str
    finished_at: datetime | None
    stop_reason: str | None
    disruption: dict[str, Any] | None
    progress: ProgressRead
    gates: list[GateRead]
    counts: dict[str, int]
    staleness: StalenessRead
    proposal: ProposalRead
    decisions: list[DecisionRead]
    observations: int


class ObservationRead(msgspec.Struct):
    id: int
    gate: str
    created_at: datetime
    payload: dict[str, Any]


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
