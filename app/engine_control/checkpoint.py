"""The demo checkpoint the cpu-demo profile serves: the trained model the project ships in engine/demo_model/,
installed on first start into FLASHGATE_MODELS_DIR/demo, in the background. Every file is copied into a hidden
directory and checked against the shipped SHA256SUMS as it is copied; only a complete, matching copy is renamed into
place, so the profile shows "weights missing" until then, and never half a checkpoint or one that does not match.
A later start whose shipped model differs from the installed one (a new image, the model replaced) installs it
again, the old one serving until the new one is in place."""

from __future__ import annotations

import hashlib
import re
import shutil
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

log = structlog.get_logger(__name__)

DEMO = "demo"
SUMS = "SHA256SUMS"
# sha256sum's line: the digest, a space, a space (text) or `*` (binary), the file's name.
SUMS_LINE = re.compile(r"(?P<digest>[0-9a-f]{64}) [ *](?P<name>[^/\\]+)")
CHUNK = 1 << 20


class CheckpointState(StrEnum):
    present = "present"
    installing = "installing"
    failed = "failed"
    # Missing, and FLASHGATE_INSTALL_DEMO=0 says not to install it.
    missing = "missing"


@dataclass(frozen=True)
class CheckpointStatus:
    state: CheckpointState
    path: Path
    started_at: datetime | None = None
    finished_at: datetime | None = None
    detail: str | None = None


def _read_sums(directory: Path) -> str | None:
    try:
        return (directory / SUMS).read_text()
    except OSError:
        return None


class InstallError(Exception):
    """Why the shipped checkpoint cannot be installed; its message is the status's detail."""


class DemoCheckpoint:
    def __init__(self, shipped: Path, models_dir: Path, db: Engine) -> None:
        self.shipped = shipped
        self.path = models_dir / DEMO
        self.db = db
        self._status = CheckpointStatus(CheckpointState.missing, self.path)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def status(self) -> CheckpointStatus:
        """Installing and failed are this console's to say; otherwise the models directory says present or missing
        (an operator may remove it)."""
        if self._status.state in (CheckpointState.installing, CheckpointState.failed):
            return self._status
        present = (self.path / "config.json").is_file()
        return replace(self._status, state=CheckpointState.present if present else CheckpointState.missing)

    def ensure(self, install: bool) -> None:
        """Start installing the shipped checkpoint in the background when `install` allows and the one at the models
        directory is missing or is not the one shipped (its SHA256SUMS differs)."""
        installed = _read_sums(self.path)
        if not install or (installed is not None and installed == _read_sums(self.shipped)):
            return
        self._status = CheckpointStatus(CheckpointState.installing, self.path, started_at=utcnow())
        replaces = self.path.exists()
        self._record("checkpoint.install", {"from": str(self.shipped), "path": str(self.path), "replaces": replaces})
        self._thread = threading.Thread(target=self._install, name="install-demo", daemon=True)
        self._thread.start()

    def wait(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def stop(self) -> None:
        """At console shutdown: a half-copied checkpoint is discarded (and installed again at the next start)."""
        self._stopping.set()
        self.wait(10)

    def _install(self) -> None:
        partial = self.path.with_name(f".{DEMO}.partial")
        old = self.path.with_name(f".{DEMO}.old")
        try:
            for leftover in (partial, old):
                shutil.rmtree(leftover, ignore_errors=True)
            self._copy_verified(partial)
            if self.path.exists():
                self.path.rename(old)
            partial.rename(self.path)
            shutil.rmtree(old, ignore_errors=True)
        except (InstallError, OSError) as exc:
            shutil.rmtree(partial, ignore_errors=True)
            detail = f"the demo checkpoint could not be installed into {self.path}: {exc}"
            self._status = replace(self._status, state=CheckpointState.failed, finished_at=utcnow(), detail=detail)
            self._record("checkpoint.failed", {"path": str(self.path), "detail": detail})
            log.error("demo_checkpoint_failed", detail=detail)
            return
        self._status = replace(self._status, state=CheckpointState.present, finished_at=utcnow())
        self._record("checkpoint.installed", {"path": str(self.path)})
        log.info("demo_checkpoint_installed", path=str(self.path), shipped=str(self.shipped))

    def _copy_verified(self, partial: Path) -> None:
        """Copy every file SHA256SUMS names into `partial`, hashing what is copied; then SHA256SUMS as it was read,
        which marks a complete install."""
        sums_path = self.shipped / SUMS
        try:
            sums = sums_path.read_text()
        except OSError as exc:
            raise InstallError(f"no shipped demo model: {sums_path} cannot be read ({exc.strerror})") from exc
        expected = {}
        for number, line in enumerate(sums.splitlines(), 1):
            match = SUMS_LINE.fullmatch(line)
            if match is None or match["name"] in (".", ".."):
                raise InstallError(f"{sums_path}, line {number}: not a sha256sum line (DIGEST  NAME): {line!r}")
            expected[match["name"]] = match["digest"]
        if "config.json" not in expected:
            raise InstallError(f"{sums_path} lists no config.json")
        partial.mkdir(parents=True)
        for name, digest in expected.items():
            got = self._copy(self.shipped / name, partial / name)
            if got != digest:
                raise InstallError(f"{self.shipped / name} has sha256 {got}, but {SUMS} says {digest}")
        (partial / SUMS).write_text(sums)

    def _copy(self, source: Path, target: Path) -> str:
        digest = hashlib.sha256()
        with source.open("rb") as src, target.open("wb") as dst:
            while chunk := src.read(CHUNK):
                if self._stopping.is_set():
                    raise InstallError("the console stopped while installing it")
                digest.update(chunk)
                dst.write(chunk)
        return digest.hexdigest()

    def _record(self, action: str, after: dict[str, str | bool]) -> None:
        with Session(self.db) as session:
            audit.record(session, "system", action, f"checkpoint:{DEMO}", after=after)
            session.commit()
