"""Decisions and the switch transaction.

The console proposes; only an operator decides. A promotion needs a finished, current run of the profile's exact
content whose failed gates each carry a waiver, a reason, and the profile's name typed to confirm. The switch is a
transaction on the one engine slot: drain and stop what serves, start the target, wait for ready, smoke, commit —
or stop the target and restore what served, recording why. A rollback is the same transaction back to the last
known good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import structlog
from litestar.exceptions import NotFoundException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.db import utcnow
from app.engine_control.preflight import CheckStatus, profile_checks
from app.errors import Conflict, FieldError, InvalidFields
from app.profiles.models import Profile
from app.promotion.models import (
    PRODUCTION,
    Decision,
    DecisionKind,
    Promotion,
    PromotionKind,
    PromotionStatus,
    Route,
    Waiver,
)
from app.promotion.roles import roles_by_profile, route_row
from app.promotion.schemas import (
    CheckRead,
    DecisionCreate,
    PlanRead,
    PromotionRead,
    RouteRead,
    StartabilityRead,
    StepRead,
)
from app.promotion.smoke import SmokeResult
from app.qualification.models import GateResult, GateStatus, QualificationRun, RunStatus
from app.qualification.service import staleness
from app.qualification.settings import QualificationSettings
from app.qualification.slot import EngineSlot, Locked, live_engine
from app.qualification.writes import writing
from app.route.models import AlertLevel
from app.route.service import raise_alert
from app.settings import Settings

log = structlog.get_logger(__name__)

SYSTEM = "system"
RECENT = 10
STOP_JOIN_S = 5.0


def promotion_target(promotion_id: int) -> str:
    return f"promotion:{promotion_id}"


def _profile(session: Session, name: str) -> Profile:
    profile = session.exec(select(Profile).where(Profile.name == name)).first()
    if profile is None:
        raise NotFoundException(f"no profile named {name!r}")
    return profile


def _name(session: Session, profile_id: int | None) -> str | None:
    return session.get(Profile, profile_id).name if profile_id is not None else None


def startability(profile: Profile, models_dir: Path) -> StartabilityRead:
    """Whether the profile can start now: its weights are there and readable and the host allows it."""
    checks, _ = profile_checks(profile, models_dir)
    failed = [c.detail for c in checks if c.status is CheckStatus.fail]
    return StartabilityRead(
        profile=profile.name,
        can_start=not failed,
        reasons=failed,
        checks=[CheckRead(c.name, c.status, c.detail) for c in checks],
    )


def read_promotion(session: Session, promotion: Promotion) -> PromotionRead:
    return PromotionRead(
        id=promotion.id,
        kind=promotion.kind,
        target=_name(session, promotion.target_id),
        previous=_name(session, promotion.previous_id),
        restore=_name(session, promotion.restore_id),
        decision=promotion.decision_id,
        reason=promotion.reason,
        status=promotion.status,
        steps=[StepRead(s["step"], s["status"], datetime.fromisoformat(s["at"]), s["detail"]) for s in promotion.steps],
        started_at=promotion.started_at,
        started_by=promotion.started_by,
        finished_at=promotion.finished_at,
        downtime_s=promotion.downtime_s,
        error=promotion.error,
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
    def __init__(
        self,
        settings: Settings,
        qualification: QualificationSettings,
        db: Engine,
        slot: EngineSlot,
        smoke: Callable[[str], SmokeResult],
    ) -> None:
        self.settings = settings
        self.qualification = qualification
        self.db = db
        self.slot = slot
        self.smoke = smoke
        self._threads: list[threading.Thread] = []

    # Reading

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
            rollback=startability(rollback, self.settings.models_dir) if rollback else None,
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
        route = route_row(session)
        restore = self._restore_target(session, kind, route)
        starts = startability(profile, self.settings.models_dir)
        approval = self.approval(session, profile)
        messages = [r.message for r in refusals] + [f"{profile.name!r} cannot start now: {r}" for r in starts.reasons]
        return PlanRead(
            kind=kind,
            target=profile.name,
            stops=live[1].name if live else None,
            starts=starts,
            rollback=startability(restore, self.settings.models_dir) if restore else None,
            allowed=not messages,
            refusals=messages,
            qualifying_run=approval.run.id if approval.run else None,
            decision=approval.decision.id if approval.decision else None,
        )

    @staticmethod
    def _restore_target(session: Session, kind: PromotionKind, route: Route | None) -> Profile | None:
        """What serves again if the target fails: production; with none yet, whatever engine runs now."""
        if route is not None and route.production_id is not None:
            return session.get(Profile, route.production_id)
        live = live_engine(session)
        return live[1] if live else None

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

    # Decisions

    def decide(self, actor: str, profile_name: str, data: DecisionCreate) -> tuple[int, int | None]:
        """Record a decision; a promotion also starts the switch. Returns the decision id and the switch's."""
        with writing(self.db) as session:
            profile = _profile(session, profile_name)
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
            kind = DecisionKind(data.decision)
            if kind is not DecisionKind.promote:
                if data.waivers:
                    raise InvalidFields([FieldError("waivers", "waivers apply to a promotion decision only")])
                return self._record(session, actor, profile, run, kind, data.reason.strip(), []), None
            waivers = self._check_promotion(session, profile, run, data)
        self.slot.acquire(f"the promotion of {profile_name!r}")
        try:
            with writing(self.db) as session:
                profile = _profile(session, profile_name)
                decision_id = self._record(session, actor, profile, run, kind, data.reason.strip(), waivers)
                promotion_id = self._create(
                    session, actor, PromotionKind.promote, profile, data.reason.strip(), decision_id
                )
        except BaseException:
            self.slot.release()
            raise
        self._launch(promotion_id, actor)
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
                    FieldError(f"waivers[{i}].reason", f"waivers[{i}].reason is required: say why the gate may fail")
                )
            seen.add(waiver.gate)
            waivers.append((waiver.gate, waiver.reason.strip()))
        if errors:
            raise InvalidFields(errors)
        refusals = [r for r in self.target_refusals(session, profile) if r.status == 423]
        if run.status is RunStatus.aborted:
            refusals.append(
                Refusal(
                    409, f"run #{run.id} stopped before its end ({run.stop_reason}): gates not run cannot be waived"
                )
            )
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

    # Switching

    def promote(self, actor: str, profile_name: str, reason: str) -> int:
        """`PUT /api/route/production`: switch to an approved profile."""
        with Session(self.db) as session:
            profile = _profile(session, profile_name)
            if not reason.strip():
                raise InvalidFields([FieldError("reason", "reason is required: say in a sentence why")])
            self._raise(self.target_refusals(session, profile))
            decision = self.approval(session, profile).decision
        return self._begin(actor, PromotionKind.promote, profile_name, reason.strip(), decision.id)

    def rollback_target(self, session: Session) -> Profile:
        route = route_row(session)
        if route is None or route.rollback_id is None:
            raise Conflict("there is no rollback profile: the first promotion over another profile makes one")
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
        return self._begin(actor, PromotionKind.rollback, name, reason.strip(), decision.id)

    def _begin(self, actor: str, kind: PromotionKind, profile_name: str, reason: str, decision_id: int) -> int:
        self.slot.acquire(f"the {kind} to {profile_name!r}")
        try:
            with writing(self.db) as session:
                promotion_id = self._create(session, actor, kind, _profile(session, profile_name), reason, decision_id)
        except BaseException:
            self.slot.release()
            raise
        self._launch(promotion_id, actor)
        return promotion_id

    def _create(
        self, session: Session, actor: str, kind: PromotionKind, profile: Profile, reason: str, decision_id: int
    ) -> int:
        live = live_engine(session)
        restore = self._restore_target(session, kind, route_row(session))
        promotion = Promotion(
            kind=kind,
            target_id=profile.id,
            previous_id=live[1].id if live else None,
            restore_id=restore.id if restore else None,
            decision_id=decision_id,
            reason=reason,
            status=PromotionStatus.running,
            started_by=actor,
        )
        session.add(promotion)
        session.flush()
        audit.record(
            session,
            actor,
            "promotion.start",
            promotion_target(promotion.id),
            after={
                "kind": kind,
                "target": profile.name,
                "stops": live[1].name if live else None,
                "restore": restore.name if restore else None,
                "decision": decision_id,
                "reason": reason,
            },
        )
        session.commit()
        return promotion.id

    def _launch(self, promotion_id: int, actor: str) -> None:
        thread = threading.Thread(
            target=self._switch, args=(promotion_id, actor), name=f"promotion-{promotion_id}", daemon=True
        )
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _step(self, promotion_id: int, actor: str, step: str, status: str, detail: str) -> None:
        with writing(self.db) as session:
            promotion = session.get(Promotion, promotion_id)
            entry = {"step": step, "status": status, "at": utcnow().isoformat(), "detail": detail}
            promotion.steps = [*promotion.steps, entry]
            audit.record(session, actor, "promotion.step", promotion_target(promotion_id), after=entry)
            session.commit()
        log.info("promotion_step", promotion=promotion_id, step=step, status=status, detail=detail)

    def _switch(self, promotion_id: int, actor: str) -> None:
        outcome: tuple[PromotionStatus, str | None] = (PromotionStatus.failed, "the switch did not finish")
        down_since = time.monotonic()
        try:
            with Session(self.db) as session:
                promotion = session.get(Promotion, promotion_id)
                target = session.get(Profile, promotion.target_id).name
                restore = _name(session, promotion.restore_id)
                decision = session.get(Decision, promotion.decision_id)
                qualified_build = session.get(QualificationRun, decision.run_id).engine_build
                live = live_engine(session)
            if live is not None:
                drain = self.slot.drain(self.qualification.drain_timeout_s)
                state = "drained" if drain["drained"] else f"{drain['in_flight']:.0f} request(s) still in flight"
                self._step(
                    promotion_id,
                    actor,
                    "drain",
                    "ok" if drain["drained"] else "timeout",
                    f"{live[1].name}: {state} after {drain['waited_s']:.1f} s (timeout {drain['timeout_s']:g} s)",
                )
                down_since = time.monotonic()
                self.slot.stop(actor)
                self._step(promotion_id, actor, "stop", "ok", f"stopped {live[1].name} (engine run #{live[0].id})")
            else:
                self._step(promotion_id, actor, "stop", "ok", "no engine was running")
            problem = self._bring_up(promotion_id, actor, target, qualified_build)
            if problem is None:
                self._commit(promotion_id, actor)
                outcome = (PromotionStatus.committed, None)
            else:
                outcome = self._restore(promotion_id, actor, target, restore, problem)
        except Exception as exc:  # a bug must not leave the slot held or the switch open
            log.exception("promotion_failed", promotion=promotion_id)
            outcome = (PromotionStatus.failed, f"the console failed during the switch: {exc!r}")
        finally:
            self._finish(promotion_id, actor, outcome, round(time.monotonic() - down_since, 2))

    def _bring_up(self, promotion_id: int, actor: str, target: str, qualified_build: str | None) -> str | None:
        """Start the target, wait for ready, smoke it; returns what went wrong, or None."""
        started = self.slot.start(actor, target)
        if not started.ready:
            where = f" (engine run #{started.engine_run_id})" if started.engine_run_id else ""
            self._step(promotion_id, actor, "start", "failed", f"{target}{where}: {started.error}")
            return f"{target} did not start: {started.error}"
        self._step(promotion_id, actor, "start", "ok", f"{target} is ready (engine run #{started.engine_run_id})")
        smoke = self.smoke(target)
        if smoke.ok and qualified_build and smoke.build != qualified_build:
            smoke = SmokeResult(
                False, f"the engine reports build {smoke.build}; {target} qualified on {qualified_build}", smoke.build
            )
        self._step(promotion_id, actor, "smoke", "ok" if smoke.ok else "failed", smoke.detail)
        return None if smoke.ok else f"the smoke failed: {smoke.detail}"

    def _commit(self, promotion_id: int, actor: str) -> None:
        with writing(self.db) as session:
            promotion = session.get(Promotion, promotion_id)
            route = route_row(session)
            before = {
                "production": _name(session, route.production_id) if route else None,
                "rollback": _name(session, route.rollback_id) if route else None,
            }
            if route is None:
                route = Route(alias=PRODUCTION, updated_by=actor)
                session.add(route)
            if promotion.kind is PromotionKind.promote:
                # The profile that served becomes the last known good; a first promotion keeps the old one.
                if route.production_id is not None and route.production_id != promotion.target_id:
                    route.rollback_id = route.production_id
            else:
                # The profile rolled back from is not known good any more.
                route.rollback_id = None
            route.production_id = promotion.target_id
            route.updated_at, route.updated_by = utcnow(), actor
            after = {"production": _name(session, route.production_id), "rollback": _name(session, route.rollback_id)}
            audit.record(session, actor, "route.production", f"route:{PRODUCTION}", before=before, after=after)
            entry = {
                "step": "commit",
                "status": "ok",
                "at": utcnow().isoformat(),
                "detail": f"production: {after['production']}; rollback: {after['rollback'] or 'none'}",
            }
            promotion.steps = [*promotion.steps, entry]
            audit.record(session, actor, "promotion.step", promotion_target(promotion_id), after=entry)
            session.commit()

    def _restore(
        self, promotion_id: int, actor: str, target: str, restore: str | None, problem: str
    ) -> tuple[PromotionStatus, str]:
        with Session(self.db) as session:
            live = live_engine(session)
        if live is not None:
            self.slot.stop(actor)
            self._step(promotion_id, actor, "stop_target", "ok", f"stopped {target} (engine run #{live[0].id})")
        if restore is None:
            self._step(promotion_id, actor, "restore", "ok", "nothing served before the switch: nothing to restore")
            return PromotionStatus.rolled_back, problem
        started = self.slot.start(actor, restore)
        if started.ready:
            self._step(
                promotion_id,
                actor,
                "restore",
                "ok",
                f"{restore} is serving again (engine run #{started.engine_run_id})",
            )
            return PromotionStatus.rolled_back, problem
        self._step(promotion_id, actor, "restore", "failed", f"{restore} did not start either: {started.error}")
        return PromotionStatus.failed, f"{problem}; restoring {restore} failed too: {started.error}"

    def _finish(
        self, promotion_id: int, actor: str, outcome: tuple[PromotionStatus, str | None], downtime_s: float
    ) -> None:
        status, error = outcome
        with writing(self.db) as session:
            promotion = session.get(Promotion, promotion_id)
            promotion.status, promotion.error = status, error
            promotion.finished_at, promotion.downtime_s = utcnow(), downtime_s
            audit.record(
                session,
                actor,
                f"promotion.{status}",
                promotion_target(promotion_id),
                before={"status": PromotionStatus.running},
                after={"status": status, "error": error, "downtime_s": downtime_s},
            )
            if status is PromotionStatus.failed:
                # Neither the target nor what served before is known to serve: operators must see it.
                target = _name(session, promotion.target_id)
                raise_alert(
                    session,
                    AlertLevel.error,
                    target,
                    f"the {promotion.kind} to {target!r} (switch #{promotion_id}) "
                    f"failed: {error}. Check the engine on the dashboard.",
                )
            session.commit()
        self.slot.release()
        log.info("promotion_finished", promotion=promotion_id, status=status, error=error, downtime_s=downtime_s)

    def recover(self) -> None:
        """At console start: a switch a previous console process left running ended with it."""
        with writing(self.db) as session:
            for promotion in session.exec(select(Promotion).where(Promotion.status == PromotionStatus.running)):
                promotion.status, promotion.finished_at = PromotionStatus.failed, utcnow()
                promotion.error = "the console restarted during the switch"
                audit.record(
                    session,
                    SYSTEM,
                    "promotion.failed",
                    promotion_target(promotion.id),
                    before={"status": PromotionStatus.running},
                    after={"status": PromotionStatus.failed, "error": promotion.error},
                )
            session.commit()

    def shutdown(self) -> None:
        for thread in self._threads:
            thread.join(timeout=STOP_JOIN_S)
