"""The supervisor: one engine owns the GPUs at a time. It starts one with a profile after a preflight, follows its
boot through the engine's own output, watches it (exit, /health), stops it with SIGTERM and a grace period, and
checks the GPU memory came back. Every state change of a run is a row update and an audit row in one transaction.

Request threads start and stop; one watcher thread per run follows the engine's output (which the driver puts in
the run's log file) and decides readiness, crashes and hangs. The database row is the truth every reader sees.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import structlog
from litestar.exceptions import NotFoundException, ServiceUnavailableException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.db import utcnow, writing
from app.engine_control import logfiles
from app.engine_control.bootlog import BootStage, LoadProgress, ReadyLine, parse_line
from app.engine_control.driver import (
    DriverError,
    EngineCommand,
    EngineDriver,
    EngineHandle,
    describe_exit,
    engine_args,
    engine_env,
)
from app.engine_control.models import EngineRun, RunState
from app.engine_control.preflight import Check, failures, memory_checks, profile_checks
from app.errors import Conflict
from app.profiles.models import Profile
from app.settings import Settings
from app.telemetry.gpus import Gpus, GpuSnapshot, engine_gpu_indices
from app.telemetry.service import EngineTarget
from app.units import byte_size

log = structlog.get_logger(__name__)

SYSTEM = "system"
TAIL_LINES = 40
POLL_S = 0.25
HEALTH_EVERY_S = 1.0
# After an exit, how long NVML may take to show the memory free again, and what "back" allows for.
RELEASE_WAIT_S = 10.0
RELEASE_TOLERANCE_BYTES = 256 << 20
LIVE_STATES = {s for s in RunState if s.live}


@dataclass(eq=False)
class LiveRun:
    """What the supervisor holds in memory about the run it is watching."""

    run_id: int
    profile: str
    handle: EngineHandle
    log_path: Path
    gpus_before: GpuSnapshot
    gpu_indices: list[int]
    state: RunState = RunState.starting
    started: float = field(default_factory=time.monotonic)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    server_info: dict[str, Any] | None = None
    # Ready needs the ready line and /health both (the ready line is read from the output, which can lag the
    # engine's HTTP side); if the output ends without one, /health alone decides.
    ready_line_seen: bool = False
    output_ended: bool = False
    # Decided before the exit (a failed boot stage, a hang, no ready in time): the state and the reason to record.
    verdict: tuple[RunState, str] | None = None
    wake: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)


def run_target(run_id: int) -> str:
    return f"engine_run:{run_id}"


def gpu_release(before: GpuSnapshot, gpus: Gpus, indices: list[int], wait_s: float = RELEASE_WAIT_S) -> dict[str, str]:
    """After an engine exits: whether its GPUs use no more memory than before its start (NVML may take a moment to
    show it free). "n/a" without NVML."""
    if not before.available:
        return {"status": "n/a", "detail": f"{before.reason}: nothing to release"}
    used_before = {g.index: g.used_bytes for g in before.gpus if g.used_bytes is not None}
    deadline = time.monotonic() + wait_s
    while True:
        held = {
            g.index: g.used_bytes - used_before[g.index]
            for g in gpus.read().gpus
            if g.index in indices and g.index in used_before and g.used_bytes is not None
        }
        held = {index: extra for index, extra in held.items() if extra > RELEASE_TOLERANCE_BYTES}
        if not held:
            names = ", ".join(f"GPU {i}" for i in indices)
            return {"status": "released", "detail": f"{names}: memory in use is back to what it was before the start"}
        if time.monotonic() >= deadline:
            detail = "; ".join(f"GPU {i}: {byte_size(n)} more in use than before the start" for i, n in held.items())
            return {"status": "held", "detail": detail}
        time.sleep(0.5)


class Supervisor:
    def __init__(self, settings: Settings, db: Engine, driver: EngineDriver, gpus: Gpus) -> None:
        self.settings = settings
        self.db = db
        self.driver = driver
        self.gpus = gpus
        # One start, stop or restart at a time; the watcher's transitions take only the state lock.
        self._command_lock = threading.RLock()
        self._state_lock = threading.Lock()
        self._live: LiveRun | None = None
        self._http = httpx.Client(timeout=2.0)

    # Reading

    def target(self) -> EngineTarget | None:
        """The ready engine, for telemetry."""
        live = self._live
        if live is None or live.state is not RunState.ready or live.server_info is None:
            return None
        return EngineTarget(live.run_id, live.profile, self.driver.base_url, live.server_info)

    # Commands

    def start(self, actor: str, profile_name: str) -> int:
        """Preflight and launch; returns the run id at once (the boot goes on in the background)."""
        with self._command_lock:
            return self._start(actor, profile_name)

    def stop(self, actor: str, keep_stopped: bool = False) -> int:
        """SIGTERM, the grace period, then a kill; returns when the run is closed. `keep_stopped`: an operator's own
        stop, after which a console restart does not start production again (a switch or a run stops to restart)."""
        with self._command_lock:
            return self._stop(actor, keep_stopped)

    def restart(self, actor: str, profile_name: str | None) -> int:
        """Stop whatever runs and start `profile_name` (by default the latest run's profile). The profile is checked
        before anything is stopped, so a restart into missing weights leaves the running engine alone."""
        with self._command_lock:
            with Session(self.db) as session:
                if profile_name is None:
                    latest = session.exec(select(EngineRun).order_by(col(EngineRun.id).desc())).first()
                    if latest is None:
                        raise Conflict("nothing to restart: no engine has run yet; start one with a profile")
                    profile_name = session.get(Profile, latest.profile_id).name
                profile = self._profile(session, profile_name)
                checks, _ = profile_checks(profile, self.settings.models_dir, self.gpus.read())
            if failed := failures(checks):
                raise Conflict(self._refusal(profile_name, failed), extra=[c.as_dict() for c in checks])
            if self._live is not None:
                # An operator's command: what it stops into another profile stays stopped across a console restart.
                self._stop(actor, keep_stopped=True)
            return self._start(actor, profile_name)

    def recover(self) -> None:
        """At console start: close the runs a previous console process left live, stopping their engines."""
        with writing(self.db) as session:
            for run in session.exec(select(EngineRun).where(col(EngineRun.state).in_(LIVE_STATES))):
                what = self.driver.reclaim(run.pid, run.container, self.settings.engine_grace_s)
                before = run.state
                run.state, run.stopped_at, run.stopped_by = RunState.stopped, utcnow(), SYSTEM
                run.last_error = f"the console restarted while this engine was {before}: {what}"
                audit.record(
                    session,
                    SYSTEM,
                    "engine.reclaimed",
                    run_target(run.id),
                    before={"state": before},
                    after={"state": RunState.stopped, "detail": what},
                )
                log.warning("engine_run_reclaimed", run=run.id, detail=what)
            session.commit()

    def shutdown(self) -> None:
        """At console shutdown: the engine goes with the console that started it."""
        if self._live is not None:
            try:
                self.stop(SYSTEM)
            except (Conflict, ServiceUnavailableException) as exc:  # gone already, or the driver cannot reach it
                log.warning("engine_not_stopped_at_shutdown", detail=exc.detail)
        self._http.close()

    # Starting

    @staticmethod
    def _profile(session: Session, name: str) -> Profile:
        profile = session.exec(select(Profile).where(Profile.name == name)).first()
        if profile is None:
            raise NotFoundException(f"no profile named {name!r}")
        return profile

    @staticmethod
    def _refusal(profile: str, failed: list[Check]) -> str:
        return f"preflight refused profile {profile!r}: " + "; ".join(c.detail for c in failed)

    def _busy(self, session: Session, run: EngineRun) -> str:
        profile = session.get(Profile, run.profile_id).name
        return (
            f"engine already running profile {profile!r} since {run.started_at:%Y-%m-%d %H:%M:%S} UTC "
            f"(run {run.id}, {run.state}); stop it first"
        )

    def _start(self, actor: str, profile_name: str) -> int:
        with Session(self.db) as session:
            live = session.exec(select(EngineRun).where(col(EngineRun.state).in_(LIVE_STATES))).first()
            if live is not None:
                raise Conflict(self._busy(session, live))
            profile = self._profile(session, profile_name)
            gpus = self.gpus.read()
            checks, fingerprint = profile_checks(profile, self.settings.models_dir, gpus)
            if fingerprint is not None:
                checks += memory_checks(profile, gpus, fingerprint)
            checks += self.driver.preflight()
            if failed := failures(checks):
                raise Conflict(self._refusal(profile_name, failed), extra=[c.as_dict() for c in checks])
            args = engine_args(profile, self.settings.models_dir, self.driver.bind_host, self.settings.engine_port)
            env = engine_env(profile)
            run = EngineRun(
                profile_id=profile.id,
                content_hash=profile.content_hash,
                weights_fingerprint=fingerprint.sha256,
                driver=self.driver.name,
                state=RunState.starting,
                command=args,
                environment=env,
                preflight=[c.as_dict() for c in checks],
                started_by=actor,
                log_path="",
            )
            session.add(run)
            session.flush()
            log_path = logfiles.run_log_path(self.settings.engine_logs_dir, run.id)
            run.log_path = str(log_path)
            audit.record(
                session,
                actor,
                "engine.start",
                run_target(run.id),
                after={
                    "state": RunState.starting,
                    "profile": profile.name,
                    "content_hash": profile.content_hash,
                    "weights_fingerprint": fingerprint.sha256,
                    "driver": self.driver.name,
                },
            )
            session.commit()
            run_id, content_hash = run.id, profile.content_hash
            gpu_indices = engine_gpu_indices(len(gpus.gpus), profile.tensor_parallel_size, profile.gpus)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log_path.touch()
        logfiles.prune(self.settings.engine_logs_dir, self.settings.log_retention)
        try:
            handle = self.driver.launch(EngineCommand(run_id, profile_name, content_hash, args, env), log_path)
        except DriverError as exc:
            self._close(run_id, RunState.failed, exit_code=None, last_error=str(exc), last_lines=[], gpu_release=None)
            raise ServiceUnavailableException(f"could not start the engine: {exc}") from exc
        live = LiveRun(
            run_id=run_id,
            profile=profile_name,
            handle=handle,
            log_path=log_path,
            gpus_before=gpus,
            gpu_indices=gpu_indices,
        )
        with self._state_lock, writing(self.db) as session:
            run = session.get(EngineRun, run_id)
            run.pid, run.container = handle.pid, handle.container
            session.commit()
            self._live = live
        log.info("engine_starting", run=run_id, profile=profile_name, pid=handle.pid, container=handle.container)
        threading.Thread(target=self._watch, args=(live,), name=f"engine-run-{run_id}", daemon=True).start()
        return run_id

    # Stopping

    def _stop(self, actor: str, keep_stopped: bool) -> int:
        live = self._live
        if live is None:
            raise Conflict("no engine is running")
        if self._transition(live, RunState.stopping, actor, "engine.stop", stopped_by=actor, keep_stopped=keep_stopped):
            try:
                live.handle.terminate(self.settings.engine_grace_s)
            except DriverError as exc:
                raise ServiceUnavailableException(f"could not stop the engine: {exc}") from exc
        live.done.wait(timeout=RELEASE_WAIT_S + 30)
        return live.run_id

    # Watching

    def _transition(self, live: LiveRun, to: RunState, actor: str, action: str, **changes: Any) -> bool:
        """Move a live run to another live state (ready, stopping); False when it has left the live states."""
        with self._state_lock, writing(self.db) as session:
            run = session.get(EngineRun, live.run_id)
            if run.state not in LIVE_STATES or run.state is RunState.stopping:
                return False
            before = run.state
            run.state = to
            for name, value in changes.items():
                setattr(run, name, value)
            after: dict[str, Any] = {"state": to}
            if to is RunState.ready:
                after |= {"kv_capacity_tokens": run.server_info.get("kv_capacity_tokens")}
            elif to is RunState.stopping:
                after |= {"keep_stopped": run.keep_stopped}
            audit.record(session, actor, action, run_target(run.id), before={"state": before}, after=after)
            session.commit()
            live.state = to
        return True

    def _close(self, run_id: int, state: RunState, **changes: Any) -> None:
        """Record the end of a run (stopped, crashed, failed) and free the supervisor for the next start."""
        with self._state_lock, writing(self.db) as session:
            run = session.get(EngineRun, run_id)
            before = run.state
            run.state, run.stopped_at = state, utcnow()
            for name, value in changes.items():
                setattr(run, name, value)
            after = {"state": state, "exit_code": run.exit_code, "last_error": run.last_error}
            after["gpu_release"] = run.gpu_release
            audit.record(session, SYSTEM, f"engine.{state}", run_target(run_id), before={"state": before}, after=after)
            session.commit()
            if self._live is not None and self._live.run_id == run_id:
                self._live = None
        log.info("engine_run_closed", run=run_id, state=state, exit_code=changes.get("exit_code"))

    def _healthy(self) -> bool:
        try:
            return self._http.get(f"{self.driver.base_url}/health").status_code == 200
        except httpx.HTTPError:
            return False

    def _mark_ready(self, live: LiveRun) -> None:
        try:
            response = self._http.get(f"{self.driver.base_url}/server_info")
            response.raise_for_status()
            info = response.json()
        except (httpx.HTTPError, ValueError):
            return  # asked again on the next health tick
        live.server_info = info
        if self._transition(live, RunState.ready, SYSTEM, "engine.ready", ready_at=utcnow(), server_info=info):
            log.info("engine_ready", run=live.run_id, kv_capacity_tokens=info.get("kv_capacity_tokens"))

    def _watch(self, live: LiveRun) -> None:
        reader = threading.Thread(target=self._read_output, args=(live,), name=f"engine-log-{live.run_id}", daemon=True)
        reader.start()
        boot_timeout = self.settings.engine_boot_timeout_s
        health_timeout = self.settings.engine_health_timeout_s
        next_health, silent_since = 0.0, None
        while (code := live.handle.exit_code()) is None:
            now = time.monotonic()
            if live.verdict is not None and live.state is not RunState.stopping:
                # Decided already; a failed boot gets its grace to exit on its own, a hang none.
                try:
                    live.handle.terminate(self.settings.engine_grace_s if live.verdict[0] is RunState.failed else 0)
                except DriverError as exc:
                    log.error("engine_kill_failed", run=live.run_id, error=str(exc))
                    live.wake.wait(HEALTH_EVERY_S)
                continue
            if live.state is RunState.starting and now - live.started > boot_timeout:
                live.verdict = (
                    RunState.failed,
                    f"not ready within {boot_timeout:.0f} s (FLASHGATE_ENGINE_BOOT_TIMEOUT_S); the engine was killed",
                )
                continue
            if live.state in (RunState.starting, RunState.ready) and (now >= next_health or live.wake.is_set()):
                live.wake.clear()
                next_health = now + HEALTH_EVERY_S
                healthy = self._healthy()
                if live.state is RunState.starting and healthy and (live.ready_line_seen or live.output_ended):
                    self._mark_ready(live)
                elif live.state is RunState.ready:
                    silent_since = None if healthy else silent_since or now
                    if silent_since is not None and now - silent_since >= health_timeout:
                        live.verdict = (
                            RunState.crashed,
                            f"/health stopped answering for {health_timeout:.0f} s "
                            f"(FLASHGATE_ENGINE_HEALTH_TIMEOUT_S); the engine was killed",
                        )
                        continue
            live.wake.wait(POLL_S)
        reader.join(timeout=5)
        self._finish(live, code)

    def _finish(self, live: LiveRun, code: int) -> None:
        if live.state is RunState.stopping:
            state, error = RunState.stopped, None
        elif live.verdict is not None:
            state, error = live.verdict
        elif live.state is RunState.starting:
            state, error = RunState.failed, f"the engine exited with {describe_exit(code)} before it was ready"
        else:
            state, error = RunState.crashed, f"the engine exited with {describe_exit(code)}"
        self._close(
            live.run_id,
            state,
            exit_code=code,
            last_error=error,
            last_lines=list(live.tail),
            gpu_release=gpu_release(live.gpus_before, self.gpus, live.gpu_indices),
        )
        live.done.set()

    def _read_output(self, live: LiveRun) -> None:
        try:
            self._follow_output(live)
        finally:
            live.output_ended = True
            live.wake.set()

    def _follow_output(self, live: LiveRun) -> None:
        for line in live.handle.lines():
            live.tail.append(line)
            event = parse_line(line)
            if isinstance(event, BootStage):
                self._record_stage(live, event)
            elif isinstance(event, ReadyLine):
                self._update(live.run_id, ready_line=event.values)
                live.ready_line_seen = True
                live.wake.set()
            elif isinstance(event, LoadProgress):
                self._update(live.run_id, load_progress=asdict(event))

    def _record_stage(self, live: LiveRun, event: BootStage) -> None:
        entry = {"stage": event.stage, "seconds": event.seconds, "at": utcnow().isoformat(), "detail": event.detail}
        with self._state_lock, writing(self.db) as session:
            run = session.get(EngineRun, live.run_id)
            run.boot_stages = [*run.boot_stages, entry]
            session.commit()
        if event.stage == "failed":
            reason = event.detail.get("error") or event.detail or "no reason given"
            live.verdict = (RunState.failed, f"the engine reported a failed boot: {reason}")
        live.wake.set()

    def _update(self, run_id: int, **changes: Any) -> None:
        """A plain change to a run (what it reported), not a state change."""
        with self._state_lock, writing(self.db) as session:
            run = session.get(EngineRun, run_id)
            for name, value in changes.items():
                setattr(run, name, value)
            session.commit()
