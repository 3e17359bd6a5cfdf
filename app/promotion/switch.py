"""The switch transaction on the one engine slot: drain and stop what serves, start the target, wait for ready, smoke
through the route, commit — or stop the target and restore what served, recording why. Every step is a row on the
switch and an audit row; a switch that ends with nothing known to serve raises an alert. A rollback is the same
transaction back to the last known good."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import structlog
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.audit.alerts import raise_alert
from app.audit.models import AlertLevel
from app.db import utcnow, writing
from app.engine_control.slot import EngineSlot, live_engine
from app.profiles.models import PRODUCTION, Profile, Route
from app.profiles.roles import route_row
from app.profiles.service import profile_named
from app.promotion.models import Promotion, PromotionKind, PromotionStatus
from app.promotion.schemas import PromotionRead, StepRead
from app.qualification.models import Decision, QualificationRun
from app.qualification.settings import QualificationSettings
from app.settings import Settings

log = structlog.get_logger(__name__)

SYSTEM = "system"
STOP_JOIN_S = 5.0


@dataclass(frozen=True)
class SmokeResult:
    """How the smoke completion through the route went (the route sends it: app/route/smoke.py)."""

    ok: bool
    detail: str
    # The build the engine reports, which must be the build the profile was qualified on.
    build: str | None
    # The HTTP status of the answer, None when none came.
    status: int | None = None


def promotion_target(promotion_id: int) -> str:
    return f"promotion:{promotion_id}"


def name_of(session: Session, profile_id: int | None) -> str | None:
    return session.get(Profile, profile_id).name if profile_id is not None else None


def promotions_by_decision(session: Session, decision_ids: list[int]) -> dict[int, int]:
    """The switch each promotion decision started, by decision id."""
    rows = session.exec(select(Promotion.decision_id, Promotion.id).where(col(Promotion.decision_id).in_(decision_ids)))
    return {decision_id: promotion_id for decision_id, promotion_id in rows}


def read_promotion(session: Session, promotion: Promotion) -> PromotionRead:
    return PromotionRead(
        id=promotion.id,
        kind=promotion.kind,
        target=name_of(session, promotion.target_id),
        previous=name_of(session, promotion.previous_id),
        restore=name_of(session, promotion.restore_id),
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


def restore_target(session: Session, kind: PromotionKind) -> Profile | None:
    """What serves again if the target fails: production; with none yet, whatever engine runs now."""
    route = route_row(session)
    if route is not None and route.production_id is not None:
        return session.get(Profile, route.production_id)
    live = live_engine(session)
    return live[1] if live else None


class Switch:
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

    def begin(self, actor: str, kind: PromotionKind, profile_name: str, reason: str, decision_id: int) -> int:
        self.slot.acquire(f"the {kind} to {profile_name!r}")
        try:
            with writing(self.db) as session:
                promotion_id = self.create(
                    session, actor, kind, profile_named(session, profile_name), reason, decision_id
                )
        except BaseException:
            self.slot.release()
            raise
        self.launch(promotion_id, actor)
        return promotion_id

    def create(
        self, session: Session, actor: str, kind: PromotionKind, profile: Profile, reason: str, decision_id: int
    ) -> int:
        live = live_engine(session)
        restore = restore_target(session, kind)
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

    def launch(self, promotion_id: int, actor: str) -> None:
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
                restore = name_of(session, promotion.restore_id)
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
                "production": name_of(session, route.production_id) if route else None,
                "rollback": name_of(session, route.rollback_id) if route else None,
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
            after = {
                "production": name_of(session, route.production_id),
                "rollback": name_of(session, route.rollback_id),
            }
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
                target = name_of(session, promotion.target_id)
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
