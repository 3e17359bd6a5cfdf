"""Reading runs: progress, per-gate results with their waivers, staleness, the console's proposal with deltas against
production on the same shape, and the evidence bundle."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from litestar.exceptions import NotFoundException
from sqlalchemy import func
from sqlmodel import Session, col, select

from app.db import utcnow
from app.engine_control import logfiles
from app.engine_control.models import EngineRun
from app.engine_control.preflight import FingerprintError, weights_fingerprint
from app.engine_control.slot import live_engine
from app.profiles.models import PRODUCTION, Profile, Route
from app.profiles.roles import production_id
from app.qualification.gates import GATES
from app.qualification.models import Decision, Evidence, GateResult, GateStatus, QualificationRun, RunStatus, Waiver
from app.qualification.schemas import (
    ComparisonRead,
    DecisionRead,
    DeltaRead,
    GateRead,
    ObservationRead,
    ProgressRead,
    ProposalRead,
    QualificationRead,
    StalenessRead,
    WaiverRead,
)

BUNDLE_SCHEMA = "flashgate.evidence/v1"
BUNDLE_LOG_LINES = 500
# (measurement, label, unit, lower is better) for the deltas against production.
DELTA_METRICS = (
    ("ttfo_s", "TTFO p50", "s", True),
    ("ttft_s", "TTFT p50", "s", True),
    ("e2e_s", "E2E p50", "s", True),
    ("prefill_tok_s", "Prefill p50", "tok/s", False),
    ("decode_tok_s", "Decode p50", "tok/s", False),
)


def get_run(session: Session, run_id: int) -> QualificationRun:
    run = session.get(QualificationRun, run_id)
    if run is None:
        raise NotFoundException(f"no qualification run with id {run_id}")
    return run


def gate_rows(session: Session, run_id: int) -> list[GateResult]:
    return list(session.exec(select(GateResult).where(GateResult.run_id == run_id).order_by(col(GateResult.position))))


def latest_build(session: Session) -> str | None:
    """The engine build this console runs now: what the latest engine start reported in /server_info."""
    # A JSON column stores None as JSON null, so filter here rather than in SQL.
    for info in session.exec(select(EngineRun.server_info).order_by(col(EngineRun.id).desc()).limit(50)):
        if info and info.get("build"):
            return info["build"]
    return None


def staleness(session: Session, run: QualificationRun, profile: Profile, models_dir: Path) -> StalenessRead:
    """Evidence is about one profile content, one engine build and one set of weights; a change of any makes it
    stale."""
    reasons = []
    if run.content_hash != profile.content_hash:
        reasons.append(
            f"the profile's content changed since the run ({run.content_hash[:12]}… → {profile.content_hash[:12]}…)"
        )
    build = latest_build(session)
    if run.engine_build and build and build != run.engine_build:
        reasons.append(f"the engine build changed: the run was on {run.engine_build}, the engine now reports {build}")
    if run.weights_fingerprint:
        try:
            now = weights_fingerprint(models_dir / profile.model).sha256
        except (OSError, FingerprintError) as exc:
            reasons.append(f"the weights cannot be read now: {exc}")
        else:
            if now != run.weights_fingerprint:
                reasons.append(
                    f"the weights changed since the run (fingerprint {run.weights_fingerprint[:12]}… → {now[:12]}…)"
                )
    return StalenessRead(bool(reasons), reasons)


# Which switch each decision started, by decision id: the promotion domain's to say (passed in from app/main.py).
Switches = Callable[[Session, list[int]], dict[int, int]]


@dataclass(frozen=True)
class RunReading:
    """What reading a run needs besides the database: the models directory (staleness reads the weights) and the
    switch each of its decisions started."""

    models_dir: Path
    switches: Switches


def decisions_for(
    session: Session, profile_id: int, switches: Switches, run_id: int | None = None
) -> list[DecisionRead]:
    query = select(Decision, Profile.name).join(Profile, col(Profile.id) == Decision.profile_id)
    query = query.where(Decision.profile_id == profile_id) if run_id is None else query.where(Decision.run_id == run_id)
    rows = session.exec(query.order_by(col(Decision.id).desc())).all()
    ids = [d.id for d, _ in rows]
    waivers: dict[int, list[WaiverRead]] = {}
    for waiver in session.exec(select(Waiver).where(col(Waiver.decision_id).in_(ids)).order_by(col(Waiver.id))):
        waivers.setdefault(waiver.decision_id, []).append(
            WaiverRead(waiver.gate, waiver.reason, waiver.operator, waiver.created_at)
        )
    from_decision = switches(session, ids)
    return [
        DecisionRead(
            id=d.id,
            profile=name,
            run=d.run_id,
            decision=d.decision,
            reason=d.reason,
            operator=d.operator,
            content_hash=d.content_hash,
            created_at=d.created_at,
            waivers=waivers.get(d.id, []),
            promotion=from_decision.get(d.id),
        )
        for d, name in rows
    ]


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None:
        return None
    return round(((end or utcnow()) - start).total_seconds(), 1)


def _progress(run: QualificationRun) -> ProgressRead:
    progress = run.progress
    gate_started = progress.get("gate_started_at")
    return ProgressRead(
        gate=progress.get("gate"),
        title=progress.get("title"),
        done=progress.get("index", 0),
        total=progress.get("total", len(GATES)),
        step=progress.get("step", ""),
        elapsed_s=_seconds(run.started_at, run.finished_at) or 0.0,
        gate_elapsed_s=_seconds(datetime.fromisoformat(gate_started), None)
        if gate_started and not run.status.finished
        else None,
    )


def performance_measurements(session: Session, run_id: int) -> dict[str, Any] | None:
    row = session.exec(select(GateResult).where(GateResult.run_id == run_id, GateResult.gate == "performance")).first()
    return row.measurements if row is not None and row.status == GateStatus.passed else None


def comparison(session: Session, run: QualificationRun, profile: Profile) -> ComparisonRead:
    """Deltas of this run's p50s against the production profile's latest run on the same shape (against the rollback
    profile once this one holds production); profiles compare only on an identical shape."""
    route = session.get(Route, PRODUCTION)
    mine = performance_measurements(session, run.id)
    if route is None or route.production_id is None:
        return ComparisonRead(None, None, False, "no profile holds the production role yet", [])
    baseline = session.get(Profile, route.production_id)
    if baseline.id == profile.id:
        # Once promoted, the report still compares: with the profile it replaced, the rollback.
        if route.rollback_id is None:
            return ComparisonRead(baseline.name, None, False, "this profile holds the production role", [])
        baseline = session.get(Profile, route.rollback_id)
    if mine is None:
        return ComparisonRead(baseline.name, None, False, "this run has no passed performance gate", [])
    theirs_run = None
    for candidate in session.exec(
        select(QualificationRun)
        .where(QualificationRun.profile_id == baseline.id)
        .order_by(col(QualificationRun.id).desc())
    ):
        theirs = performance_measurements(session, candidate.id)
        if theirs is not None and theirs.get("shape") == mine.get("shape"):
            theirs_run = candidate
            break
    if theirs_run is None:
        return ComparisonRead(
            baseline.name, None, False, f"{baseline.name} has no performance evidence on this shape", []
        )
    deltas = []
    for metric, label, unit, lower_better in DELTA_METRICS:
        this, that = mine["p50"].get(metric), theirs["p50"].get(metric)
        delta = round((this - that) / that * 100, 1) if this is not None and that else None
        better = None if delta is None or delta == 0 else (delta < 0) == lower_better
        deltas.append(DeltaRead(metric, label, unit, this, that, delta, better))
    return ComparisonRead(baseline.name, theirs_run.id, True, f"against {baseline.name} run #{theirs_run.id}", deltas)


def proposal(
    run: QualificationRun, gates: list[GateResult], stale: StalenessRead, compared: ComparisonRead
) -> ProposalRead:
    """What the console proposes; an operator decides."""
    failed = [g.gate for g in gates if g.status == GateStatus.failed]
    if not run.status.finished:
        return ProposalRead("pending", "the run is still going", [], failed, compared)
    if run.status is RunStatus.aborted:
        return ProposalRead(
            "none",
            f"no proposal: the run was aborted ({run.stop_reason or 'the ladder stopped'})",
            [
                run.stop_reason or "the ladder stopped",
                "an aborted run decides nothing: gates not run cannot be waived; fix the cause and qualify again",
            ],
            failed,
            compared,
        )
    if stale.stale:
        return ProposalRead("requalify", "requalify: the evidence is stale", stale.reasons, failed, compared)
    if failed:
        return ProposalRead(
            "no_promotion",
            f"no promotion: {len(failed)} gate(s) failed ({', '.join(failed)})",
            [f"{g.gate}: {g.summary}" for g in gates if g.status == GateStatus.failed]
            + ["promoting anyway needs a waiver with a reason for each failed gate"],
            failed,
            compared,
        )
    reasons = ["every gate passed or does not apply here"]
    better = [d for d in compared.deltas if d.better]
    worse = [d for d in compared.deltas if d.better is False]
    reasons += [f"{d.label} {d.delta_pct:+.1f}% vs {compared.against}" for d in better + worse]
    return ProposalRead("promote", "promote: every gate passed", reasons, failed, compared)


def _gate_read(row: GateResult, observations: int, waiver: WaiverRead | None) -> GateRead:
    gate = GATES[row.gate]
    end = row.finished_at or (utcnow() if row.status == GateStatus.running else None)
    return GateRead(
        name=row.gate,
        version=row.version,
        title=gate.title,
        kind=gate.kind,
        position=row.position,
        status=row.status,
        summary=row.summary,
        pass_rule=gate.pass_rule,
        inputs=row.inputs,
        measurements=row.measurements,
        started_at=row.started_at,
        finished_at=row.finished_at,
        seconds=round((end - row.started_at).total_seconds(), 2) if row.started_at and end else None,
        observations=observations,
        waiver=waiver,
    )


def read_run(session: Session, run_id: int, reading: RunReading) -> QualificationRead:
    run = get_run(session, run_id)
    profile = session.get(Profile, run.profile_id)
    gates = gate_rows(session, run_id)
    counts = dict(
        session.exec(
            select(Evidence.gate, func.count()).where(Evidence.run_id == run_id).group_by(col(Evidence.gate))
        ).all()
    )
    decisions = decisions_for(session, profile.id, reading.switches, run_id)
    # The waivers of the latest promotion decision on this run are the ones in force.
    promote = next((d for d in decisions if d.decision == "promote"), None)
    waived = {w.gate: w for w in promote.waivers} if promote else {}
    stale = staleness(session, run, profile, reading.models_dir)
    compared = comparison(session, run, profile)
    status_counts: dict[str, int] = {}
    for row in gates:
        status_counts[row.status] = status_counts.get(row.status, 0) + 1
    return QualificationRead(
        id=run.id,
        profile=profile.name,
        status=run.status,
        ladder=run.ladder,
        scale=run.scale,
        content_hash=run.content_hash,
        weights_fingerprint=run.weights_fingerprint,
        engine_build=run.engine_build,
        engine_run=run.engine_run_id,
        started_at=run.started_at,
        started_by=run.started_by,
        finished_at=run.finished_at,
        stop_reason=run.stop_reason,
        disruption=run.disruption,
        progress=_progress(run),
        gates=[_gate_read(g, counts.get(g.gate, 0), waived.get(g.gate)) for g in gates],
        counts=status_counts,
        staleness=stale,
        proposal=proposal(run, gates, stale, compared),
        decisions=decisions,
        observations=sum(counts.values()),
    )


def list_runs(session: Session, profile_id: int, reading: RunReading, limit: int = 20) -> list[QualificationRead]:
    ids = session.exec(
        select(QualificationRun.id)
        .where(QualificationRun.profile_id == profile_id)
        .order_by(col(QualificationRun.id).desc())
        .limit(limit)
    ).all()
    return [read_run(session, run_id, reading) for run_id in ids]


def observations(session: Session, run_id: int, gate: str | None = None) -> list[ObservationRead]:
    query = select(Evidence).where(Evidence.run_id == run_id)
    if gate is not None:
        query = query.where(Evidence.gate == gate)
    return [
        ObservationRead(e.id, e.gate, e.created_at, e.payload) for e in session.exec(query.order_by(col(Evidence.id)))
    ]


def bundle(session: Session, run_id: int, reading: RunReading) -> dict[str, Any]:
    """Everything the run left, as one JSON document: the run with its gates, proposal and decisions, the gate
    definitions, every observation, and the engine run with the end of its log."""
    run = read_run(session, run_id, reading)
    row = get_run(session, run_id)
    profile = session.get(Profile, row.profile_id)
    engine = session.get(EngineRun, row.engine_run_id) if row.engine_run_id else None
    engine_part = None
    if engine is not None:
        engine_part = {
            "id": engine.id,
            "state": engine.state,
            "command": engine.command,
            "preflight": engine.preflight,
            "boot_stages": engine.boot_stages,
            "server_info": engine.server_info,
            "ready_line": engine.ready_line,
            "last_error": engine.last_error,
            "log_path": engine.log_path,
            "log_tail": logfiles.tail_lines(Path(engine.log_path), BUNDLE_LOG_LINES),
        }
    return {
        "schema": BUNDLE_SCHEMA,
        "exported_at": utcnow().isoformat(),
        "run": msgspec.to_builtins(run),
        "profile": {
            "name": profile.name,
            "content_hash": profile.content_hash,
            "model": profile.model,
            "revision": profile.revision,
            "context_length": profile.context_length,
            "max_num_batched_tokens": profile.max_num_batched_tokens,
            "max_num_seqs": profile.max_num_seqs,
            "gpu_memory_utilization": profile.gpu_memory_utilization,
            "kv_cache_dtype": profile.kv_cache_dtype,
            "cuda_graph_max_bs": profile.cuda_graph_max_bs,
            "tensor_parallel_size": profile.tensor_parallel_size,
            "attention": profile.attention,
            "gpus": profile.gpus,
            "max_output_tokens": profile.max_output_tokens,
            "engine_extras": profile.engine_extras,
        },
        "gate_definitions": [GATES[g.name].definition() for g in run.gates],
        "observations": msgspec.to_builtins(observations(session, run_id)),
        "engine_run": engine_part,
    }


RECENT_RUNS = 5


def profile_page(session: Session, profile: Profile, reading: RunReading) -> dict[str, Any]:
    """What a profile's page shows from qualification: its recent runs, and what a run of it would stop (and restore
    afterwards)."""
    live = live_engine(session)
    return {
        "runs": list_runs(session, profile.id, reading, limit=RECENT_RUNS),
        "serving": live[1].name if live else None,
        "serving_production": bool(live and production_id(session) == live[1].id),
    }
