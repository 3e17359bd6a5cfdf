"""The one engine slot that qualification runs and promotion switches share: the supervisor runs one engine at a
time, so whoever needs it holds the slot (a second holder gets 423), drains what serves with a timeout, stops it,
starts its own profile and waits for ready."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
from litestar.exceptions import ClientException, HTTPException
from litestar.status_codes import HTTP_423_LOCKED
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.db import utcnow
from app.engine_control.models import EngineRun, RunState
from app.engine_control.supervisor import Supervisor
from app.profiles.models import Profile
from app.telemetry import prometheus

DRAIN_POLL_S = 0.5
READY_POLL_S = 0.2
# A start gets the supervisor's own boot timeout; this is on top, for the supervisor to record the verdict.
READY_GRACE_S = 30.0
LIVE = [s for s in RunState if s.live]
IN_FLIGHT = ("flashgate_requests_running", "flashgate_requests_waiting")
STEPS = "flashgate_steps_total"


class Locked(ClientException):
    """Another transaction holds the engine: a qualification run or a promotion switch."""

    status_code = HTTP_423_LOCKED
    detail = "a qualification run, a switch or the production watch holds the engine: `detail` names it"


@dataclass(frozen=True)
class Holder:
    what: str
    since: datetime


@dataclass(frozen=True)
class Progress:
    """What the engine's /metrics says about its work: requests running or waiting, and the steps it has run (decode
    and prefill; the count moves with every step, however long the queue)."""

    in_flight: int
    steps: int | None


@dataclass(frozen=True)
class Started:
    """How a start ended: the run id (None when the supervisor refused it) and, unless ready, why not."""

    engine_run_id: int | None
    ready: bool
    error: str | None


def live_engine(session: Session) -> tuple[EngineRun, Profile] | None:
    row = session.exec(
        select(EngineRun, Profile)
        .join(Profile, col(Profile.id) == EngineRun.profile_id)
        .where(col(EngineRun.state).in_(LIVE))
        .order_by(col(EngineRun.id).desc())
    ).first()
    return (row[0], row[1]) if row else None


class EngineSlot:
    def __init__(self, db: Engine, supervisor: Supervisor, boot_timeout_s: float) -> None:
        self.db = db
        self.supervisor = supervisor
        self.boot_timeout_s = boot_timeout_s
        self._lock = threading.Lock()
        self._holder: Holder | None = None

    @property
    def holder(self) -> Holder | None:
        return self._holder

    def check(self) -> None:
        """423 while someone holds the engine."""
        if (held := self._holder) is not None:
            raise Locked(
                f"the engine is held by {held.what} since {held.since:%H:%M:%S} UTC; try again when it is done"
            )

    def acquire(self, what: str) -> None:
        with self._lock:
            self.check()
            self._holder = Holder(what, utcnow())

    def release(self) -> None:
        with self._lock:
            self._holder = None

    @contextmanager
    def holding(self, what: str) -> Iterator[None]:
        """Hold the engine for the length of one command (an operator's start, stop or restart): 423 naming the holder
        while a run, a switch or the watch has it, and none of them takes it from under the command."""
        self.acquire(what)
        try:
            yield
        finally:
            self.release()

    @property
    def base_url(self) -> str:
        return self.supervisor.driver.base_url

    def progress(self, http: httpx.Client) -> Progress | None:
        """The engine's work as its /metrics reports it; None when it does not answer."""
        try:
            response = http.get(f"{self.base_url}/metrics")
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        samples = prometheus.parse(response.text)
        in_flight = sum(prometheus.total(samples, name) or 0 for name in IN_FLIGHT)
        steps = prometheus.total(samples, STEPS)
        return Progress(int(in_flight), None if steps is None else int(steps))

    def drain(self, timeout_s: float) -> dict[str, Any]:
        """Wait until the engine has no request running or waiting (its own /metrics), or the timeout. The agent
        route admits nothing new while the slot is held, so only what was in flight is waited for."""
        start = time.monotonic()
        in_flight: int | None = None
        with httpx.Client(timeout=2.0) as http:
            while True:
                progress = self.progress(http)
                in_flight = progress.in_flight if progress else None  # gone or not ready: nothing to wait for
                if not in_flight or time.monotonic() - start >= timeout_s:
                    break
                time.sleep(DRAIN_POLL_S)
        waited = round(time.monotonic() - start, 2)
        return {"drained": not in_flight, "waited_s": waited, "in_flight": in_flight, "timeout_s": timeout_s}

    def stop(self, actor: str) -> int:
        return self.supervisor.stop(actor)

    def start(self, actor: str, profile: str) -> Started:
        """Start a profile and wait until it is ready, failed or out of time."""
        try:
            run_id = self.supervisor.start(actor, profile)
        except HTTPException as exc:  # the preflight refused it, or the driver could not launch it
            return Started(None, False, str(exc.detail))
        deadline = time.monotonic() + self.boot_timeout_s + READY_GRACE_S
        while True:
            with Session(self.db) as session:
                run = session.get(EngineRun, run_id)
                state, error = run.state, run.last_error
            if state is RunState.ready:
                return Started(run_id, True, None)
            if not state.live:
                return Started(run_id, False, error or f"the engine {state}")
            if time.monotonic() > deadline:
                return Started(run_id, False, f"not ready after {self.boot_timeout_s + READY_GRACE_S:.0f} s")
            time.sleep(READY_POLL_S)

    def engine_gone(self, engine_run_id: int) -> str | None:
        """None while this engine run is ready and answers /health; otherwise why not."""
        for attempt in range(3):
            with Session(self.db) as session:
                run = session.get(EngineRun, engine_run_id)
                state, error, stopped_by = run.state, run.last_error, run.stopped_by
            if state is not RunState.ready:
                if stopped_by:
                    return f"the engine was stopped by {stopped_by}"
                return f"the engine {state}" + (f": {error}" if error else "")
            try:
                if httpx.get(f"{self.base_url}/health", timeout=5).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            if attempt < 2:
                time.sleep(1.0)
        return "the engine stopped answering /health"
