"""The demo model the cpu-demo profile serves (trained, shipped with the project in engine/demo_model/), put in
place on first start by the engine's own tool as a subprocess (`python -m engine.tools.demo_model`, which checks
every file against the shipped SHA256SUMS), in the background, into a hidden directory renamed into place when
complete: the profile shows "weights missing" until then, never half a checkpoint or a damaged one."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from datetime import datetime
from enum import StrEnum
from pathlib import Path

import structlog
from sqlalchemy import Engine
from sqlmodel import Session

from app.audit import service as audit
from app.db import utcnow
from app.engine_control.logfiles import tail_lines

log = structlog.get_logger(__name__)

DEMO = "demo"


class CheckpointState(StrEnum):
    present = "present"
    making = "making"
    failed = "failed"
    # Missing, and FLASHGATE_INSTALL_DEMO=0 says not to put it in place.
    missing = "missing"


@dataclass(frozen=True)
class CheckpointStatus:
    state: CheckpointState
    path: Path
    started_at: datetime | None = None
    finished_at: datetime | None = None
    detail: str | None = None


class DemoCheckpoint:
    def __init__(self, models_dir: Path, logs_dir: Path, db: Engine) -> None:
        self.path = models_dir / DEMO
        self.log_path = logs_dir / "install-demo.log"
        self.db = db
        self._status = CheckpointStatus(CheckpointState.missing, self.path)
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def status(self) -> CheckpointStatus:
        if self._status.state is not CheckpointState.making and (self.path / "config.json").is_file():
            return replace(self._status, state=CheckpointState.present)
        return self._status

    def ensure(self, make: bool) -> None:
        """Start putting the checkpoint in place in the background when it is missing and `make` allows."""
        if not make or self.status().state is CheckpointState.present:
            return
        self._status = CheckpointStatus(CheckpointState.making, self.path, started_at=utcnow())
        self._record("checkpoint.make", {"path": str(self.path)})
        self._thread = threading.Thread(target=self._make, name="install-demo", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """At console shutdown: a half-copied checkpoint is discarded (and copied again at the next start)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.wait(10)

    def _make(self) -> None:
        partial = self.path.with_name(f".{DEMO}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as out:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "engine.tools.demo_model", "--out", str(partial)],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                code = self._proc.wait()
            except OSError as exc:
                out.write(f"could not run {sys.executable}: {exc}\n")
                code = None
        if code == 0:
            partial.rename(self.path)
            self._status = replace(self._status, state=CheckpointState.present, finished_at=utcnow())
            self._record("checkpoint.made", {"path": str(self.path)})
            log.info("demo_checkpoint_made", path=str(self.path))
            return
        shutil.rmtree(partial, ignore_errors=True)
        last = " | ".join(tail_lines(self.log_path, 5))
        detail = f"python -m engine.tools.demo_model failed (exit code {code}): {last}"
        self._status = replace(self._status, state=CheckpointState.failed, finished_at=utcnow(), detail=detail)
        self._record("checkpoint.failed", {"path": str(self.path), "detail": detail})
        log.error("demo_checkpoint_failed", detail=detail, log=str(self.log_path))

    def _record(self, action: str, after: dict[str, str]) -> None:
        with Session(self.db) as session:
            audit.record(session, "system", action, f"checkpoint:{DEMO}", after=after)
            session.commit()
