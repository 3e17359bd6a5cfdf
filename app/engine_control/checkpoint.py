"""The tiny CPU checkpoint the cpu-demo profile serves, made on first start by the engine's own tool as a subprocess
(`python -m engine.tools.make_tiny`), in the background, into a hidden directory renamed into place when complete:
the profile shows "weights missing" until then, never half a checkpoint."""

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

TINY = "tiny"


class CheckpointState(StrEnum):
    present = "present"
    making = "making"
    failed = "failed"
    # Missing, and FLASHGATE_MAKE_TINY=0 says not to make it.
    missing = "missing"


@dataclass(frozen=True)
class CheckpointStatus:
    state: CheckpointState
    path: Path
    started_at: datetime | None = None
    finished_at: datetime | None = None
    detail: str | None = None


class TinyCheckpoint:
    def __init__(self, models_dir: Path, logs_dir: Path, db: Engine) -> None:
        self.path = models_dir / TINY
        self.log_path = logs_dir / "make-tiny.log"
        self.db = db
        self._status = CheckpointStatus(CheckpointState.missing, self.path)
        self._thread: threading.Thread | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    def status(self) -> CheckpointStatus:
        if self._status.state is not CheckpointState.making and (self.path / "config.json").is_file():
            return replace(self._status, state=CheckpointState.present)
        return self._status

    def ensure(self, make: bool) -> None:
        """Start making the checkpoint in the background when it is missing and `make` allows."""
        if not make or self.status().state is CheckpointState.present:
            return
        self._status = CheckpointStatus(CheckpointState.making, self.path, started_at=utcnow())
        self._record("checkpoint.make", {"path": str(self.path)})
        self._thread = threading.Thread(target=self._make, name="make-tiny", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """At console shutdown: a half-made checkpoint is discarded (and made again at the next start)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.wait(10)

    def _make(self) -> None:
        partial = self.path.with_name(f".{TINY}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("w") as out:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", "engine.tools.make_tiny", "--out", str(partial)],
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
            log.info("tiny_checkpoint_made", path=str(self.path))
            return
        shutil.rmtree(partial, ignore_errors=True)
        last = " | ".join(tail_lines(self.log_path, 5))
        detail = f"python -m engine.tools.make_tiny failed (exit code {code}): {last}"
        self._status = replace(self._status, state=CheckpointState.failed, finished_at=utcnow(), detail=detail)
        self._record("checkpoint.failed", {"path": str(self.path), "detail": detail})
        log.error("tiny_checkpoint_failed", detail=detail, log=str(self.log_path))

    def _record(self, action: str, after: dict[str, str]) -> None:
        with Session(self.db) as session:
            audit.record(session, "system", action, f"checkpoint:{TINY}", after=after)
            session.commit()
