"""Reading engine runs for the API and the pages."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from litestar.exceptions import NotFoundException
from sqlmodel import Session, col, select

from app.engine_control import logfiles
from app.engine_control.checkpoint import DemoCheckpoint
from app.engine_control.models import EngineRun
from app.engine_control.schemas import (
    IDLE,
    BootStageRead,
    CheckpointRead,
    EngineRead,
    GpuReleaseRead,
    LogTail,
    PreflightCheckRead,
    RunRead,
)
from app.engine_control.slot import EngineSlot
from app.profiles.models import Profile


def _stage(entry: dict, started_at: datetime) -> BootStageRead:
    at = datetime.fromisoformat(entry["at"])
    return BootStageRead(entry["stage"], entry["seconds"], at, (at - started_at).total_seconds(), entry["detail"])


def read_run(run: EngineRun, profile: str) -> RunRead:
    info = run.server_info or {}
    return RunRead(
        id=run.id,
        profile=profile,
        content_hash=run.content_hash,
        weights_fingerprint=run.weights_fingerprint,
        driver=run.driver,
        state=run.state,
        command=run.command,
        environment=run.environment or {},
        preflight=[PreflightCheckRead(**c) for c in run.preflight],
        started_at=run.started_at,
        started_by=run.started_by,
        ready_at=run.ready_at,
        stopped_at=run.stopped_at,
        stopped_by=run.stopped_by,
        keep_stopped=run.keep_stopped,
        exit_code=run.exit_code,
        pid=run.pid,
        container=run.container,
        log_path=run.log_path,
        log_retained=Path(run.log_path).is_file(),
        boot_stages=[_stage(entry, run.started_at) for entry in run.boot_stages],
        load_progress=run.load_progress,
        ready_line=run.ready_line,
        kv_capacity_tokens=info.get("kv_capacity_tokens"),
        max_concurrency_at_full_context=info.get("max_concurrency_at_full_context"),
        server_info=run.server_info,
        last_error=run.last_error,
        last_lines=run.last_lines,
        gpu_release=GpuReleaseRead(**run.gpu_release) if run.gpu_release else None,
    )


def list_runs(session: Session, limit: int) -> list[RunRead]:
    rows = session.exec(
        select(EngineRun, Profile.name)
        .join(Profile, col(Profile.id) == EngineRun.profile_id)
        .order_by(col(EngineRun.id).desc())
        .limit(limit)
    ).all()
    return [read_run(run, name) for run, name in rows]


def get_run(session: Session, run_id: int) -> RunRead:
    run = session.get(EngineRun, run_id)
    if run is None:
        raise NotFoundException(f"no engine run with id {run_id}")
    return read_run(run, session.get(Profile, run.profile_id).name)


def read_checkpoint(checkpoint: DemoCheckpoint) -> CheckpointRead:
    status = checkpoint.status()
    return CheckpointRead(status.state, str(status.path), status.started_at, status.finished_at, status.detail)


def engine_status(session: Session, slot: EngineSlot, checkpoint: DemoCheckpoint) -> EngineRead:
    latest = next(iter(list_runs(session, 1)), None)
    supervisor, holder = slot.supervisor, slot.holder
    return EngineRead(
        state=latest.state if latest else IDLE,
        driver=supervisor.driver.name,
        engine_url=supervisor.driver.base_url,
        profile=latest.profile if latest else None,
        run=latest,
        demo_checkpoint=read_checkpoint(checkpoint),
        held_by=f"{holder.what} since {holder.since:%H:%M:%S} UTC" if holder else None,
    )


def log_tail(session: Session, run_id: int | None, lines: int) -> LogTail:
    """The end of a run's log (by default the latest run's)."""
    if run_id is None:
        run_id = session.exec(select(EngineRun.id).order_by(col(EngineRun.id).desc())).first()
        if run_id is None:
            raise NotFoundException("no engine has run yet: there is no log")
    run = get_run(session, run_id)
    path = Path(run.log_path)
    return LogTail(run.id, run.log_path, run.log_retained, logfiles.tail_lines(path, lines))
