"""The production watch: on a timer, whether the production engine is alive and makes progress. The supervisor marks
an engine that exits, or whose /health goes silent, as crashed; the watch adds what /health does not show, a hang:
an engine with requests running or waiting whose step counter (`flashgate_steps_total` in its /metrics) stands still
for FLASHGATE_WATCH_CANARY_TIMEOUT_S. A long queue is not a hang, however long a request waits in it. An idle engine
(or one whose /metrics is silent) gets a canary completion through the route, which waits behind nobody. A crash or
a hang restarts production; more failures than FLASHGATE_WATCH_RESTARTS within FLASHGATE_WATCH_WINDOW_S roll back to
the last known good (the same switch an operator runs). Each step is an audit row and an alert on the console.

The watch leaves alone what people do: nothing while a switch, a qualification run or an operator's command holds
the engine, and nothing when an operator stopped production or runs another profile (the route answers 503 then).

When the console starts (a reboot, a container update), the previous console's engine has gone with it; the watch
first starts production again, so an appliance comes back serving (FLASHGATE_RESUME_PRODUCTION). Not when an
operator stopped production by hand: the engine controls mark that run `keep_stopped`, and production stays stopped
until someone starts it. A switch, a qualification run, the watch and the console's own shutdown stop production
only to bring it back, so after them it resumes. A resume that fails counts as a failed restart.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass

import httpx
import structlog
from litestar.exceptions import HTTPException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.audit.alerts import raise_alert
from app.audit.models import AlertLevel
from app.db import writing
from app.engine_control.models import EngineRun, RunState
from app.engine_control.slot import EngineSlot, Locked, live_engine
from app.errors import Conflict
from app.profiles.models import Profile
from app.profiles.roles import route_row
from app.promotion.decisions import Promoter
from app.route.proxy import WATCH_CANARY, AgentRoute
from app.route.smoke import route_smoke
from app.settings import Settings

log = structlog.get_logger(__name__)

WATCH = "watch"
TARGET = "route:production"
STOP_JOIN_S = 5.0
# How long a failed canary waits for the supervisor to record an exit, before it calls the engine hung.
EXIT_NOTICE_S = 2.0
RESTARTED = "console restarted"
METRICS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Seen:
    run: int
    steps: int | None
    at: float


class ProductionWatch:
    def __init__(self, settings: Settings, db: Engine, slot: EngineSlot, promoter: Promoter, route: AgentRoute) -> None:
        self.settings = settings
        self.db = db
        self.slot = slot
        self.promoter = promoter
        self.route = route
        self._failures: deque[float] = deque()
        self._production: str | None = None
        # The crashed or failed run already dealt with, so a run that stays the latest is not counted twice.
        self._handled_run: int | None = None
        # When production's engine was last seen stepping (or idle): a run id, its step count and the time.
        self._seen: Seen | None = None
        self._http = httpx.Client(timeout=METRICS_TIMEOUT_S)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="production-watch", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=STOP_JOIN_S)
        self._http.close()

    def _run(self) -> None:
        if self.settings.resume_production:
            try:
                self.resume()
            except Exception:  # the watch goes on without it
                log.exception("watch_resume_failed")
        while not self._stop.wait(self.settings.watch_interval_s):
            try:
                self.check()
            except Exception:  # the watch must outlive a bad tick
                log.exception("watch_check_failed")

    def resume(self) -> None:
        """At console start: start production when no engine runs, unless an operator stopped it by hand."""
        with Session(self.db) as session:
            route = route_row(session)
            if route is None or route.production_id is None or live_engine(session) is not None:
                return
            production = session.get(Profile, route.production_id).name
            last = session.exec(
                select(EngineRun).where(EngineRun.profile_id == route.production_id).order_by(col(EngineRun.id).desc())
            ).first()
        if last is not None and last.keep_stopped:
            stopped = f"{last.stopped_by} stopped it at {last.stopped_at:%Y-%m-%d %H:%M:%S} UTC (engine run #{last.id})"
            reason = f"{RESTARTED}: production stays stopped, {stopped}"
            log.info("watch_production_stays_stopped", profile=production, reason=reason)
            self._record("watch.stays_stopped", production, {"reason": reason, "engine_run": last.id})
            return
        try:
            self.slot.acquire(f"the production watch resuming {production!r}")
        except Locked:
            return  # someone took the engine first: what they do decides
        try:
            log.info("watch_resuming_production", profile=production)
            self._record(
                "watch.resume",
                production,
                {"reason": f"{RESTARTED}: resuming production", "last_run": last.id if last else None},
            )
            started = self.slot.start(WATCH, production)
        finally:
            self.slot.release()
        if not started.ready and not self._stop.is_set():
            self._record(
                "watch.resume_failed",
                production,
                {"engine_run": started.engine_run_id, "error": started.error},
                AlertLevel.error,
                f"production {production!r} did not start again after the {RESTARTED}: {started.error}",
            )

    def check(self) -> None:
        """One look at production; restarts or rolls back when it is down."""
        with Session(self.db) as session:
            route = route_row(session)
            production = session.get(Profile, route.production_id).name if route and route.production_id else None
            latest = session.exec(select(EngineRun).order_by(col(EngineRun.id).desc())).first()
            latest_profile = session.get(Profile, latest.profile_id).name if latest else None
        if production != self._production:
            self._production, self._handled_run = production, None
            self._failures.clear()
        if production is None or latest is None or latest_profile != production or self.slot.holder is not None:
            return
        if latest.state is RunState.ready:
            self._judge_progress(production, latest)
        elif latest.id == self._handled_run:
            return
        elif latest.state is RunState.crashed:
            self._failed(production, latest, "crash", latest.last_error or "the engine crashed")
        elif latest.state is RunState.failed and latest.started_by == WATCH:
            self._failed(production, latest, "restart_failed", latest.last_error or "the restart failed")

    def _judge_progress(self, production: str, run: EngineRun) -> None:
        """A hang is an engine with work that runs no step, not one whose queue is long. With requests in flight the
        step counter in its /metrics decides; an idle engine (or one whose /metrics is silent) gets the canary, which
        then waits behind nobody, and fails only if the engine ran no step meanwhile."""
        now = time.monotonic()
        before = self.slot.progress(self._http)
        if self._seen is None or self._seen.run != run.id:
            self._seen = Seen(run.id, before.steps if before else None, now)
        if before is not None and before.steps is not None and before.steps != self._seen.steps:
            self._seen = Seen(run.id, before.steps, now)
        if before is not None and before.in_flight and before.steps is not None:
            stalled = now - self._seen.at
            if stalled >= self.settings.watch_canary_timeout_s:
                self._failed(
                    production,
                    run,
                    "hang",
                    f"{before.in_flight} request(s) running or waiting and no engine step for {stalled:.0f} s",
                )
            return
        canary = route_smoke(self.route, production, WATCH_CANARY, self.settings.watch_canary_timeout_s)
        # A full queue (429) is an engine that answers; the slot taken meanwhile means someone else acts; a console
        # shutting down answers nothing.
        if canary.ok or canary.status == 429 or self.slot.holder is not None or self._stop.is_set():
            self._seen = Seen(run.id, self._seen.steps, time.monotonic())
            return
        after = self.slot.progress(self._http)
        if after is not None and after.steps is not None and after.steps != (before.steps if before else None):
            self._seen = Seen(run.id, after.steps, time.monotonic())
            return  # agents' requests came in and the engine steps through them: busy, not hung
        if self._exited(run.id):
            return  # a crash, not a hang: the next check sees it as one
        self._failed(production, run, "hang", f"the canary completion failed: {canary.detail}")

    def _exited(self, run_id: int) -> bool:
        """Whether the run left the ready state within a moment (the supervisor notices an exit within a poll)."""
        deadline = time.monotonic() + EXIT_NOTICE_S
        while True:
            with Session(self.db) as session:
                if session.get(EngineRun, run_id).state is not RunState.ready:
                    return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.2)

    def _failed(self, production: str, run: EngineRun, kind: str, detail: str) -> None:
        now = time.monotonic()
        self._failures.append(now)
        while self._failures and now - self._failures[0] > self.settings.watch_window_s:
            self._failures.popleft()
        self._handled_run = run.id
        count, bound = len(self._failures), self.settings.watch_restarts
        what = f"production {production!r} (engine run #{run.id}): {kind.replace('_', ' ')}: {detail}"
        log.warning("watch_failure", profile=production, run=run.id, kind=kind, detail=detail, failures=count)
        self._record(
            f"watch.{kind}",
            production,
            {"engine_run": run.id, "detail": detail, "failures": count, "window_s": self.settings.watch_window_s},
        )
        if count <= bound:
            self._restart(production, run, kind, what, count)
        else:
            self._roll_back(production, what, count)

    def _restart(self, production: str, run: EngineRun, kind: str, what: str, count: int) -> None:
        try:
            self.slot.acquire(f"the production watch restarting {production!r}")
        except Locked:
            return  # someone else took the engine meanwhile; the next check looks again
        try:
            if kind == "hang":
                with contextlib.suppress(Conflict):  # it may have died meanwhile: then there is nothing to stop
                    self.slot.stop(WATCH)
            started = self.slot.start(WATCH, production)
        finally:
            self.slot.release()
        attempt = f"restart {count} of {self.settings.watch_restarts}"
        if started.ready:
            message = f"{what}. {attempt}: serving again (engine run #{started.engine_run_id})."
            level = AlertLevel.warning
        else:
            message = f"{what}. {attempt} failed: {started.error}"
            level = AlertLevel.error
        self._record(
            "watch.restart",
            production,
            {"engine_run": started.engine_run_id, "ready": started.ready, "error": started.error, "attempt": count},
            level,
            message,
        )

    def _roll_back(self, production: str, what: str, count: int) -> None:
        self._failures.clear()
        within = f"{count} failures within {self.settings.watch_window_s:g} s"
        reason = f"the production watch: {within}; the last: {what}"
        try:
            with Session(self.db) as session:
                target = self.promoter.rollback_target(session).name
            promotion_id = self.promoter.rollback(WATCH, reason)
        except HTTPException as exc:
            message = f"{what}. {within}, and no rollback is possible: {exc.detail}. Nothing serves the route."
            self._record("watch.gave_up", production, {"error": exc.detail}, AlertLevel.error, message)
            return
        message = f"{what}. {within}: rolling back to {target!r} (switch #{promotion_id})."
        self._record("watch.rollback", production, {"promotion": promotion_id, "to": target}, AlertLevel.error, message)

    def _record(
        self,
        action: str,
        production: str,
        after: dict,
        level: AlertLevel | None = None,
        message: str | None = None,
    ) -> None:
        """The audit row, and with a message the alert operators see."""
        with writing(self.db) as session:
            audit.record(session, WATCH, action, TARGET, after={"profile": production, **after})
            if message is not None:
                raise_alert(session, level, production, message)
            session.commit()
