"""Decisions and what they allow. The console proposes; only an operator decides. A promotion needs a finished,
current run of the profile's exact content whose failed gates each carry a waiver, a reason, and the profile's name
typed to confirm; then the switch (app/promotion/switch.py) moves the production role. The route's view (production,
rollback and whether it can start now, challengers, rejected, switches) and a dry run of any switch are read here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.db import writing
from app.engine_control.preflight import CheckStatus, profile_checks
from app.engine_control.slot import EngineSlot, Locked, live_engine
from app.errors import Conflict, FieldError, InvalidFields
from app.profiles.models import Profile
from app.profiles.roles import route_row
from app.profiles.service import profile_named
from app.promotion.models import Promotion, PromotionKind, PromotionStatus
from app.promotion.roles import roles_by_profile
from app.promotion.schemas import CheckRead, PlanRead, RouteRead, StartabilityRead
from app.promotion.switch import Switch, read_promotion, restore_target
from app.qualification.models import Decision, DecisionKind, GateResult, GateStatus, QualificationRun, RunStatus, Waiver
from app.qualification.schemas import DecisionCreate
from app.qualification.service import staleness
from app.settings import Settings
from app.telemetry.gpus import GpuSnapshot

log = structlog.get_logger(__name__)

RECENT = 10


def startability(profile: Profile, models_dir: Path, gpus: GpuSnapshot) -> StartabilityRead:
    """Whether the profile can start now: its weights are there and readable and the host (its GPUs) allows it."""
    checks, _ = profile_checks(profile, models_dir, gpus)
    failed = [c.detail for c in checks if c.status is CheckStatus.fail]
    return StartabilityRead(
        profile=profile.name,
        can_start=not failed,
        reasons=failed,
        checks=[CheckRead(c.name, c.status, c.detail) for c in checks],
    )


@dataclass(frozen=True)
class Refusal:
    status: int
    message: str


@dataclass(frozen=True)
class Approval:
    """The decision in force for a profile's current content and the run behind it."""

    decision: Decision | None
    run: QualificationRun | None
    refusals: list[Refusal]


class Promoter:
    def __init__(self, settings: Settings, db: Engine, slot: EngineSlot, switch: Switch) -> None:
        self.settings = settings
        self.db = db
        self.slot = slot
        self.switch = switch

    # Reading

    def _gpus(self) -> GpuSnapshot:
        return self.slot.supervisor.gpus.read()

    def route(self, session: Session) -> RouteRead:
        route = route_row(session)
        roles = roles_by_profile(session)
        names = dict(session.exec(select(Profile.id, Profile.name)).all())
        running = session.exec(select(Promotion).where(Promotion.status == PromotionStatus.running)).first()
        recent = session.exec(select(Promotion).order_by(col(Promotion.id).desc()).limit(RECENT)).all()
        rollback = session.get(Profile, route.rollback_id) if route and route.rollback_id else None
        holder = self.slot.holder
        return RouteRead(
            production=names.get(route.production_id) if route else None,
            rollback=startability(rollback, self.settings.models_dir, self._gpus()) if rollback else None,
            challengers=sorted(names[i] for i, r in roles.items() if "challenger" in r),
            rejected=sorted(names[i] for i, r in roles.items() if "rejected" in r),
            updated_at=route.updated_at if route else None,
            updated_by=route.updated_by if route else None,
            transaction=read_promotion(session, running) if running else None,
            recent=[read_promotion(session, p) for p in recent],
            locked_by=holder.what if holder else None,
        )

    def approval(self, session: Session, profile: Profile) -> Approval:
        latest = session.exec(
            select(Decision).where(Decision.profile_id == profile.id).order_by(col(Decision.id).desc())
        ).first()
        if latest is None or latest.decision is not DecisionKind.promote:
            what = f"its latest decision is {latest.decision} (#{latest.id})" if latest else "it has no decision"
            return Approval(
                latest,
                None,
                [
                    Refusal(
                        409,
                        f"{profile.name!r} is not approved: {what}; an operator decides at "
                        f"POST /api/profiles/{profile.name}/decisions",
                    )
                ],
            )
        run = session.get(QualificationRun, latest.run_id)
        if latest.content_hash != profile.content_hash:
            return Approval(
                latest, run, [Refusal(409, f"{profile.name!r} is not approved: its content changed since decision")]
            )
        stale = staleness(session, run, profile, self.settings.models_dir)
        if stale.stale:
            return Approval(
                latest, run, [Refusal(409, f"run #{run.id} of {profile.name!r} is stale: {'; '.join(stale.reasons)}")]
            )
        return Approval(latest, run, [])

    def plan(self, session: Session, kind: PromotionKind, profile: Profile, refusals: list[Refusal]) -> PlanRead:
        live = live_engine(session)
        restore = restore_target(session, kind)
        starts = startability(profile, self.settings.models_dir, self._gpus())
        approval = self.approval(session, profile)
        messages = [r.message for r in refusals] + [f"{profile.name!r} cannot start now: {r}" for r in starts.reasons]
        return PlanRead(
            kind=kind,
            target=profile.name,
            stops=live[1].name if live else None,
            starts=starts,
            rollback=startability(restore, self.settings.models_dir, self._gpus()) if restore else None,
            allowed=not messages,
            refusals=messages,
            qualifying_run=approval.run.id if approval.run else None,
            decision=approval.decision.id if approval.decision else None,
        )

    def target_refusals(self, session: Session, profile: Profile) -> list[Refusal]:
        refusals = []
        if self.slot.holder is not None:
            refusals.append(Refusal(423, f"locked: the engine is held by {self.slot.holder.what}"))
        route = route_row(session)
        if profile.retired:
            refusals.append(Refusal(409, f"{profile.name!r} is retired"))
        if route is not None and route.production_id == profile.id:
            refusals.append(Refusal(409, f"{profile.name!r} already holds the production role"))
        refusals += self.approval(session, profile).refusals
        return refusals

    @staticmethod
    def _raise(refusals: list[Refusal]) -> None:
        if locked := [r for r in refusals if r.status == 423]:
            raise Locked(locked[0].message)
        if refusals:
            raise Conflict("; ".join(r.message for r in refusals))

    def decide(self, actor: str, profile_name: str, data: DecisionCreate) -> tuple[int, int | None]:
        """Record a decision; a promotion also starts the switch. Returns the decision id and the switch's."""
        with writing(self.db) as session:
            profile = profile_named(session, profile_name)
            errors = []
            if data.decision not in {k.value for k in DecisionKind}:
                errors.append(
                    FieldError(
                        "decision",
                        f"decision must be one of {', '.join(k.value for k in DecisionKind)}; got {data.decision!r}",
                    )
                )
            if not data.reason.strip():
                errors.append(FieldError("reason", "reason is required: say in a sentence why"))
            if errors:
                raise InvalidFields(errors)
            run = self._decided_run(session, profile, data.run)
            if run.status is RunStatus.aborted:
                # Its gates not run decide nothing, whatever the decision and its waivers say.
                raise Conflict(
                    f"run #{run.id} was aborted ({run.stop_reason or 'the ladder stopped'}): an aborted run decides "
                    f"nothing; fix the cause and qualify {profile.name!r} again"
                )
            kind = DecisionKind(data.decision)
            if kind is not DecisionKind.promote:
                if data.waivers:
                    raise InvalidFields([FieldError("waivers", "waivers apply to a promotion decision only")])
                return self._record(session, actor, profile, run, kind, data.reason.strip(), []), None
            waivers = self._check_promotion(session, profile, run, data)
        self.slot.acquire(f"the promotion of {profile_name!r}")
        try:
            with writing(self.db) as session:
                profile = profile_named(session, profile_name)
                decision_id = self._record(session, actor, profile, run, kind, data.reason.strip(), waivers)
                promotion_id = self.switch.create(
                    session, actor, PromotionKind.promote, profile, data.reason.strip(), decision_id
                )
        except BaseException:
            self.slot.release()
            raise
        self.switch.launch(promotion_id, actor)
        return decision_id, promotion_id

    @staticmethod
    def _decided_run(session: Session, profile: Profile, run_id: int | None) -> QualificationRun:
        if run_id is None:
            run = session.exec(
                select(QualificationRun)
                .where(
                    QualificationRun.profile_id == profile.id,
                    col(QualificationRun.status).in_([RunStatus.passed, RunStatus.failed, RunStatus.aborted]),
                )
                .order_by(col(QualificationRun.id).desc())
            ).first()
            if run is None:
                raise Conflict(f"{profile.name!r} has no finished qualification run to decide on: qualify it first")
            return run
        run = session.get(QualificationRun, run_id)
        if run is None or run.profile_id != profile.id:
            raise InvalidFields(
                [FieldError("run", f"run must be a qualification run of {profile.name!r}; got {run_id}")]
            )
        if not run.status.finished:
            raise Conflict(f"run #{run.id} is still {run.status}: decide once it has finished")
        return run

    def _check_promotion(
        self, session: Session, profile: Profile, run: QualificationRun, data: DecisionCreate
    ) -> list[tuple[str, str]]:
        """The promotion's refusals, most fundamental first; returns the waivers as (gate, reason)."""
        if data.confirm.strip() != profile.name:
            raise InvalidFields(
                [
                    FieldError(
                        "confirm",
                        f"confirm must be the profile's name {profile.name!r}, typed exactly, to promote it; "
                        f"got {data.confirm!r}",
                    )
                ]
            )
        failed = {
            g.gate: g.summary
            for g in session.exec(select(GateResult).where(GateResult.run_id == run.id))
            if g.status == GateStatus.failed
        }
        errors, waivers, seen = [], [], set()
        for i, waiver in enumerate(data.waivers):
            if waiver.gate not in failed:
                errors.append(
                    FieldError(
                        f"waivers[{i}].gate",
                        f"waivers[{i}].gate must name a gate that failed in run #{run.id} "
                        f"({', '.join(sorted(failed)) or 'none failed'}); got {waiver.gate!r}",
                    )
                )
            elif waiver.gate in seen:
                errors.append(FieldError(f"waivers[{i}].gate", f"waivers[{i}].gate {waiver.gate!r} is waived twice"))
            if not waiver.reason.strip():
                errors.append(
                    FieldError(
                        f"waivers[{i}].reason",
                        f"the waiver of {waiver.gate!r} needs a reason (waivers[{i}].reason): say why it may fail",
                    )
                )
            seen.add(waiver.gate)
            waivers.append((waiver.gate, waiver.reason.strip()))
        if errors:
            raise InvalidFields(errors)
        refusals = [r for r in self.target_refusals(session, profile) if r.status == 423]
        if run.content_hash != profile.content_hash:
            refusals.append(Refusal(409, f"run #{run.id} qualified other content than {profile.name!r} has now"))
        stale = staleness(session, run, profile, self.settings.models_dir)
        if stale.stale:
            refusals.append(Refusal(409, f"run #{run.id} is stale: {'; '.join(stale.reasons)}; qualify it again"))
        if unwaived := sorted(set(failed) - seen):
            refusals.append(
                Refusal(
                    409,
                    f"run #{run.id} is not qualified: {', '.join(unwaived)} failed without a waiver; waive each with "
                    f"a reason, or qualify again",
                )
            )
        route = route_row(session)
        if route is not None and route.production_id == profile.id:
            refusals.append(Refusal(409, f"{profile.name!r} already holds the production role"))
        if profile.retired:
            refusals.append(Refusal(409, f"{profile.name!r} is retired"))
        self._raise(refusals)
        return waivers

    @staticmethod
    def _record(
        session: Session,
        actor: str,
        profile: Profile,
        run: QualificationRun,
        kind: DecisionKind,
        reason: str,
        waivers: list[tuple[str, str]],
    ) -> int:
        decision = Decision(
            profile_id=profile.id,
            run_id=run.id,
            decision=kind,
            reason=reason,
            operator=actor,
            content_hash=profile.content_hash,
        )
        session.add(decision)
        session.flush()
        for gate, why in waivers:
            session.add(Waiver(decision_id=decision.id, gate=gate, reason=why, operator=actor))
        audit.record(
            session,
            actor,
            f"decision.{kind}",
            f"profile:{profile.name}",
            after={
                "decision": decision.id,
                "run": run.id,
                "reason": reason,
                "waivers": [{"gate": gate, "reason": why} for gate, why in waivers],
            },
        )
        session.commit()
        return decision.id

    def promote(self, actor: str, profile_name: str, reason: str) -> int:
        """`PUT /api/route/production`: switch to an approved profile."""
        with Session(self.db) as session:
            profile = profile_named(session, profile_name)
            if not reason.strip():
                raise InvalidFields([FieldError("reason", "reason is required: say in a sentence why")])
            self._raise(self.target_refusals(session, profile))
            decision = self.approval(session, profile).decision
        return self.switch.begin(actor, PromotionKind.promote, profile_name, reason.strip(), decision.id)

    def rollback_target(self, session: Session) -> Profile:
        route = route_row(session)
        if route is None or route.rollback_id is None:
            production = session.get(Profile, route.production_id) if route and route.production_id else None
            makes = (
                f"the next promotion over {production.name!r} makes it the rollback"
                if production
                else "the first promotion over another profile makes one"
            )
            raise Conflict(f"there is no rollback profile: {makes}")
        return session.get(Profile, route.rollback_id)

    def rollback(self, actor: str, reason: str) -> int:
        """`POST /api/route/rollback`: the same transaction back to the last known good."""
        with Session(self.db) as session:
            profile = self.rollback_target(session)
            if not reason.strip():
                raise InvalidFields([FieldError("reason", "reason is required: say in a sentence why")])
            self._raise(self.target_refusals(session, profile))
            decision = self.approval(session, profile).decision
            name = profile.name
        return self.switch.begin(actor, PromotionKind.rollback, name, reason.strip(), decision.id)
