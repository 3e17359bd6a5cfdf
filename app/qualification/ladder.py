"""Qualification runs: start the engine with the profile through the supervisor, run the ladder in order, keep every
observation as evidence, and give the engine slot back as it was.

Only a dead, unreachable or crashed engine stops the ladder; a failed answer fails its gate and the ladder goes on.
Gates that read only what the ladder kept (VRAM samples, the engine's log) run even after the engine died, so a
crash still leaves its traceback in the evidence. A run that finds an engine serving drains it (with a timeout),
stops it, and restores it afterwards, recording the downtime.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import structlog
from litestar.exceptions import HTTPException, NotFoundException
from sqlalchemy import Engine
from sqlmodel import Session, col, select

from app.audit import service as audit
from app.audit.alerts import raise_alert
from app.audit.models import AlertLevel
from app.db import utcnow, writing
from app.engine_control.models import EngineRun
from app.engine_control.preflight import failures, profile_checks
from app.engine_control.slot import EngineSlot, Started, live_engine
from app.errors import Conflict
from app.profiles.models import PRODUCTION, Profile, Route
from app.qualification.client import EngineClient
from app.qualification.gates import LADDER
from app.qualification.gates.base import LADDER_VERSION, Gate, GateContext, LadderPlan, Verdict
from app.qualification.models import Evidence, GateResult, GateStatus, QualificationRun, RunStatus
from app.qualification.service import RunReading
from app.qualification.settings import QualificationSettings
from app.settings import Settings
from app.telemetry.gpus import Gpus, engine_gpu_indices

log = structlog.get_logger(__name__)

SYSTEM = "system"
STOP_JOIN_S = 5.0


def run_target(run_id: int) -> str:
    return f"qualification:{run_id}"


class Qualifier:
    def __init__(
        self,
        settings: Settings,
        qualification: QualificationSettings,
        db: Engine,
        slot: EngineSlot,
        gpus: Gpus,
        reading: RunReading,
    ) -> None:
        self.settings = settings
        # How the API and the pages read its runs.
        self.reading = reading
        self.qualification = qualification
        self.db = db
        self.slot = slot
        self.gpus = gpus
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # Commands

    def start(self, actor: str, profile_name: str, confirm_downtime: bool) -> int:
        """Check the profile can start, take the engine slot, and run the ladder in the background; returns the run
        id at once. 409 with the reason (an engine serving without `confirm_downtime`, a preflight refusal), 423
        while another run or a switch holds the engine."""
        self.slot.check()
        with Session(self.db) as session:
            profile = session.exec(select(Profile).where(Profile.name == profile_name)).first()
            if profile is None:
                raise NotFoundException(f"no profile named {profile_name!r}")
            if profile.retired:
                raise Conflict(f"profile {profile_name!r} is retired: it can no longer be qualified")
            checks, _ = profile_checks(profile, self.settings.models_dir, self.gpus.read())
            if failed := failures(checks):
                raise Conflict(
                    f"cannot qualify {profile_name!r}: " + "; ".join(c.detail for c in failed),
                    extra=[c.as_dict() for c in checks],
                )
            live = live_engine(session)
            if live is not None and not confirm_downtime:
                serving = live[1].name
                role = " (production)" if self._production_id(session) == live[1].id else ""
                raise Conflict(
                    f"the engine is running profile {serving!r}{role}: qualifying {profile_name!r} drains and stops it "
                    f"for the run and restores it afterwards; confirm with confirm_downtime: true"
                )
        self.slot.acquire(f"qualification of {profile_name!r}")
        try:
            run_id = self._create(actor, profile_name)
        except BaseException:
            self.slot.release()
            raise
        thread = threading.Thread(target=self._run, args=(run_id, actor), name=f"qualification-{run_id}", daemon=True)
        self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return run_id

    def recover(self) -> None:
        """At console start: runs a previous console process left unfinished end as aborted."""
        with writing(self.db) as session:
            unfinished = [RunStatus.waiting, RunStatus.starting, RunStatus.running]
            for run in session.exec(select(QualificationRun).where(col(QualificationRun.status).in_(unfinished))):
                before = run.status
                run.status, run.finished_at = RunStatus.aborted, utcnow()
                run.stop_reason = f"the console restarted while the run was {before}"
                for gate in session.exec(select(GateResult).where(GateResult.run_id == run.id)):
                    if gate.status in (GateStatus.pending, GateStatus.running):
                        gate.status, gate.summary = GateStatus.not_run, f"not run: {run.stop_reason}"
                audit.record(
                    session,
                    SYSTEM,
                    "qualification.aborted",
                    run_target(run.id),
                    before={"status": before},
                    after={"status": RunStatus.aborted, "stop_reason": run.stop_reason},
                )
            session.commit()

    def shutdown(self) -> None:
        """At console shutdown: the ladder stops between gates; a run cut short is closed by recover()."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(timeout=STOP_JOIN_S)

    # The run

    @staticmethod
    def _production_id(session: Session) -> int | None:
        route = session.get(Route, PRODUCTION)
        return route.production_id if route else None

    def _create(self, actor: str, profile_name: str) -> int:
        with writing(self.db) as session:
            profile = session.exec(select(Profile).where(Profile.name == profile_name)).one()
            run = QualificationRun(
                profile_id=profile.id,
                content_hash=profile.content_hash,
                ladder=LADDER_VERSION,
                status=RunStatus.waiting,
                progress={"gate": None, "index": 0, "total": len(LADDER), "step": "waiting for the engine"},
                started_by=actor,
            )
            session.add(run)
            session.flush()
            for position, gate in enumerate(LADDER):
                session.add(
                    GateResult(
                        run_id=run.id,
                        position=position,
                        gate=gate.name,
                        version=gate.version,
                        status=GateStatus.pending,
                        summary="",
                    )
                )
            audit.record(
                session,
                actor,
                "qualification.start",
                run_target(run.id),
                after={
                    "profile": profile_name,
                    "content_hash": profile.content_hash,
                    "ladder": LADDER_VERSION,
                    "gates": [f"{g.name}/v{g.version}" for g in LADDER],
                },
            )
            session.commit()
            log.info("qualification_started", run=run.id, profile=profile_name)
            return run.id

    def _update(self, run_id: int, **changes: Any) -> None:
        with writing(self.db) as session:
            run = session.get(QualificationRun, run_id)
            for name, value in changes.items():
                setattr(run, name, value)
            session.commit()

    def _progress(self, run_id: int, **fields: Any) -> None:
        with writing(self.db) as session:
            run = session.get(QualificationRun, run_id)
            run.progress = {**run.progress, **fields}
            session.commit()

    def _run(self, run_id: int, actor: str) -> None:
        disruption: dict[str, Any] | None = None
        engine_run_id: int | None = None
        stop_reason: str | None = None
        try:
            with Session(self.db) as session:
                run = session.get(QualificationRun, run_id)
                profile = session.get(Profile, run.profile_id)
                profile_name = profile.name
                live = live_engine(session)
                if live is not None:
                    disruption = {
                        "profile": live[1].name,
                        "production": self._production_id(session) == live[1].id,
                        "engine_run": live[0].id,
                    }
            if disruption is not None:
                self._displace(run_id, actor, disruption)
            self._update(run_id, status=RunStatus.starting)
            self._progress(run_id, step=f"starting the engine with {profile_name}")
            started = self.slot.start(actor, profile_name)
            engine_run_id = started.engine_run_id
            stop_reason = self._ladder(run_id, profile_name, started)
        except Exception as exc:  # a bug must not leave the slot held or the run open
            log.exception("qualification_failed", run=run_id)
            stop_reason = f"the console failed during the run: {exc!r}"
        finally:
            self._close(run_id, actor, engine_run_id, disruption, stop_reason)

    def _displace(self, run_id: int, actor: str, disruption: dict[str, Any]) -> None:
        """Drain and stop what serves. The stop time is noted before the stop, so whatever ends the run afterwards,
        its close knows to restore what it displaced."""
        self._progress(
            run_id, step=f"draining {disruption['profile']} (up to {self.qualification.drain_timeout_s:g} s)"
        )
        drain = self.slot.drain(self.qualification.drain_timeout_s)
        disruption |= {"drain": drain, "stopped_at": utcnow().isoformat(), "stopped_monotonic": time.monotonic()}
        with contextlib.suppress(Conflict):  # it ended by itself meanwhile: nothing left to stop
            self.slot.stop(actor)
        with writing(self.db) as session:
            audit.record(
                session,
                actor,
                "qualification.displace",
                run_target(run_id),
                after={"profile": disruption["profile"], "production": disruption["production"], "drain": drain},
            )
            session.commit()

    def _ladder(self, run_id: int, profile_name: str, started: Started) -> str | None:
        """Run the gates in order; returns why the ladder stopped early, or None."""
        with Session(self.db) as session:
            run = session.get(QualificationRun, run_id)
            profile = session.get(Profile, run.profile_id)
            engine_run = session.get(EngineRun, started.engine_run_id) if started.engine_run_id else None
            limits = {
                "context_length": profile.context_length,
                "max_num_seqs": profile.max_num_seqs,
                "max_num_batched_tokens": profile.max_num_batched_tokens,
            }
            tp, chosen, profile_id = profile.tensor_parallel_size, profile.gpus, profile.id
        info = (engine_run.server_info if engine_run else None) or {}
        gpus = self.gpus.read()
        plan = LadderPlan.of(
            profile_name,
            limits,
            (info.get("config") or {}).get("device"),
            self.qualification.vram_reserve_gib,
            tuple(engine_gpu_indices(len(gpus.gpus), tp, chosen)),
        )
        boot = self._boot(engine_run)
        client = EngineClient(self.slot.base_url, profile_name, self.qualification.request_timeout_s)
        ctx = GateContext(
            client=client,
            plan=plan,
            observe=lambda gate, payload: self._observe(profile_id, run_id, gate, payload),
            report=lambda step: self._progress(run_id, step=step),
            health=lambda: self.slot.engine_gone(started.engine_run_id) is None,
            read_gpus=self._read_gpus,
            boot=boot,
            log_path=Path(engine_run.log_path) if engine_run else None,
        )
        stop_reason = None
        if started.ready:
            self._update(
                run_id,
                status=RunStatus.running,
                scale=plan.scale,
                engine_run_id=started.engine_run_id,
                engine_build=info.get("build"),
                weights_fingerprint=engine_run.weights_fingerprint,
            )
        else:
            stop_reason = f"the engine did not get ready: {started.error}"
            self._update(run_id, status=RunStatus.running, engine_run_id=started.engine_run_id)
        try:
            for index, gate in enumerate(LADDER):
                ctx.gate = gate.name
                if self._stopping.is_set() and stop_reason is None:
                    stop_reason = "the console is shutting down"
                if stop_reason is not None and gate.needs_engine:
                    self._gate_done(run_id, gate, Verdict(GateStatus.not_run, f"not run: {stop_reason}"))
                    continue
                if not started.ready and gate.name == "readiness":
                    ctx.note("boot", boot)
                    self._gate_done(run_id, gate, Verdict(GateStatus.failed, stop_reason, boot))
                    continue
                inputs = gate.inputs(plan)
                self._gate_start(run_id, gate, index, inputs)
                try:
                    verdict = gate.run(ctx, inputs)
                except Exception as exc:  # a gate's bug is a failed gate with the reason, not a dead ladder
                    log.exception("gate_crashed", run=run_id, gate=gate.name)
                    verdict = Verdict(GateStatus.failed, f"the gate itself failed: {exc!r}")
                self._gate_done(run_id, gate, verdict)
                if gate.needs_engine and stop_reason is None:
                    gone = self.slot.engine_gone(started.engine_run_id)
                    if gone is not None:
                        stop_reason = f"{gone} (during {gate.name})"
        finally:
            client.close()
        return stop_reason

    @staticmethod
    def _boot(engine_run: EngineRun | None) -> dict[str, Any]:
        if engine_run is None:
            return {}
        load = (engine_run.ready_at - engine_run.started_at).total_seconds() if engine_run.ready_at else None
        return {
            "engine_run": engine_run.id,
            "load_seconds": round(load, 2) if load is not None else None,
            "boot_stages": {s["stage"]: s["seconds"] for s in engine_run.boot_stages},
            "state": engine_run.state,
            "last_error": engine_run.last_error,
            "last_lines": engine_run.last_lines[-20:],
        }

    def _read_gpus(self) -> dict[str, Any]:
        snapshot = self.gpus.read()
        return {
            "at": utcnow().isoformat(),
            "available": snapshot.available,
            "reason": snapshot.reason,
            "gpus": [
                {"index": g.index, "name": g.name, "free_bytes": g.free_bytes, "total_bytes": g.total_bytes}
                for g in snapshot.gpus
            ],
        }

    def _observe(self, profile_id: int, run_id: int, gate: str, payload: dict[str, Any]) -> None:
        with writing(self.db) as session:
            session.add(Evidence(profile_id=profile_id, run_id=run_id, gate=gate, payload=payload))
            session.commit()

    def _gate_start(self, run_id: int, gate: Gate, index: int, inputs: dict[str, Any]) -> None:
        with writing(self.db) as session:
            row = session.exec(
                select(GateResult).where(GateResult.run_id == run_id, GateResult.gate == gate.name)
            ).one()
            row.status, row.inputs, row.started_at = GateStatus.running, inputs, utcnow()
            run = session.get(QualificationRun, run_id)
            run.progress = {
                "gate": gate.name,
                "title": gate.title,
                "index": index,
                "total": len(LADDER),
                "step": "",
                "gate_started_at": row.started_at.isoformat(),
            }
            session.commit()

    def _gate_done(self, run_id: int, gate: Gate, verdict: Verdict) -> None:
        with writing(self.db) as session:
            row = session.exec(
                select(GateResult).where(GateResult.run_id == run_id, GateResult.gate == gate.name)
            ).one()
            row.status, row.summary, row.measurements = verdict.status, verdict.summary, verdict.measurements
            row.finished_at = utcnow()
            audit.record(
                session,
                SYSTEM,
                "qualification.gate",
                run_target(run_id),
                after={
                    "gate": gate.name,
                    "version": gate.version,
                    "status": verdict.status,
                    "summary": verdict.summary,
                },
            )
            session.commit()
        log.info("gate_finished", run=run_id, gate=gate.name, status=verdict.status)

    def _close(
        self,
        run_id: int,
        actor: str,
        engine_run_id: int | None,
        disruption: dict[str, Any] | None,
        stop_reason: str | None,
    ) -> None:
        try:
            try:
                self._stop_own_engine(run_id, engine_run_id)
            except Exception:  # nothing may keep the close from restoring what the run displaced
                log.exception("qualification_stop_failed", run=run_id)
            # Whatever ended the run, what it displaced comes back, or an alert says it could not.
            if disruption is not None and "stopped_monotonic" in disruption:
                disruption = self._restore(run_id, actor, disruption)
            status = self._record_end(run_id, disruption, stop_reason)
            log.info("qualification_finished", run=run_id, status=status, stop_reason=stop_reason)
        finally:
            self.slot.release()

    def _stop_own_engine(self, run_id: int, engine_run_id: int | None) -> None:
        self._progress(run_id, step="stopping the engine")
        with Session(self.db) as session:
            live = live_engine(session)
        if live is not None and live[0].id == engine_run_id:
            try:
                self.slot.stop(SYSTEM)
            except HTTPException as exc:  # gone meanwhile, or the driver failed: the restore says what follows
                log.warning("qualification_engine_not_stopped", run=run_id, detail=exc.detail)

    def _record_end(self, run_id: int, disruption: dict[str, Any] | None, stop_reason: str | None) -> RunStatus:
        with writing(self.db) as session:
            run = session.get(QualificationRun, run_id)
            gates = session.exec(select(GateResult).where(GateResult.run_id == run_id)).all()
            for gate in gates:
                if gate.status in (GateStatus.pending, GateStatus.running):
                    gate.status, gate.summary = GateStatus.not_run, f"not run: {stop_reason}"
            if stop_reason is not None:
                status = RunStatus.aborted
            elif any(g.status == GateStatus.failed for g in gates):
                status = RunStatus.failed
            else:
                status = RunStatus.passed
            before = run.status
            run.status, run.finished_at, run.stop_reason = status, utcnow(), stop_reason
            run.disruption = disruption
            run.progress = {**run.progress, "step": "", "gate": None, "index": len(LADDER)}
            audit.record(
                session,
                SYSTEM,
                f"qualification.{status}",
                run_target(run_id),
                before={"status": before},
                after={
                    "status": status,
                    "stop_reason": stop_reason,
                    "passed": [g.gate for g in gates if g.status == GateStatus.passed],
                    "failed": [g.gate for g in gates if g.status == GateStatus.failed],
                },
            )
            session.commit()
        return status

    def _restore(self, run_id: int, actor: str, disruption: dict[str, Any]) -> dict[str, Any]:
        profile = disruption["profile"]
        try:
            self._progress(run_id, step=f"restoring {profile}")
            started = self.slot.start(actor, profile)
        except Exception as exc:  # a bug here must still leave an alert, not a silent stranded production
            log.exception("qualification_restore_crashed", run=run_id, profile=profile)
            started = Started(None, False, f"the console failed starting it: {exc!r}")
        downtime = round(time.monotonic() - disruption.pop("stopped_monotonic"), 2)
        disruption |= {
            "restored": started.ready,
            "restore_error": started.error,
            "restored_engine_run": started.engine_run_id,
            "restored_at": utcnow().isoformat(),
            "downtime_s": downtime,
        }
        with writing(self.db) as session:
            audit.record(
                session,
                actor,
                "qualification.restore" if started.ready else "qualification.restore_failed",
                run_target(run_id),
                after={"profile": profile, "ready": started.ready, "error": started.error, "downtime_s": downtime},
            )
            if not started.ready:
                role = " (production)" if disruption["production"] else ""
                serving = " Nothing serves the route until an operator starts it." if disruption["production"] else ""
                raise_alert(
                    session,
                    AlertLevel.error,
                    profile,
                    f"qualification run #{run_id} stopped {profile!r}{role} for its run and could not start it "
                    f"again: {started.error}.{serving}",
                )
            session.commit()
        return disruption
