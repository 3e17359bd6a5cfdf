"""The `process` driver: the engine as a child process of the console, on loopback."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from app.engine_control.driver import DriverError, EngineCommand, EngineHandle
from app.engine_control.preflight import Check, CheckStatus

LOOPBACK = "127.0.0.1"
FOLLOW_POLL_S = 0.1


def _signal_group(pid: int, sig: signal.Signals) -> None:
    """The engine runs in a session of its own, so its helpers (compiler workers) go with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class ProcessHandle:
    container = None

    def __init__(self, proc: subprocess.Popen[bytes], log_path: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.log_path = log_path

    def lines(self) -> Iterator[str]:
        """Follow the log file the engine writes (`tail -f`), until the engine has exited and all is read."""
        with self.log_path.open("rb") as log:
            pending = b""
            while True:
                chunk = log.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith(b"\n"):
                        yield pending.decode(errors="replace").rstrip("\n")
                        pending = b""
                elif self.proc.poll() is not None:
                    for line in (pending + log.read()).splitlines():
                        yield line.decode(errors="replace")
                    return
                else:
                    time.sleep(FOLLOW_POLL_S)

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def terminate(self, grace_s: float) -> int | None:
        if self.proc.poll() is None and grace_s > 0:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        if self.proc.poll() is None:
            _signal_group(self.pid, signal.SIGKILL)
        code = self.proc.wait()
        _signal_group(self.pid, signal.SIGKILL)  # whatever of the group outlived its leader
        return code


def _is_engine(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"engine" in argv and b"serve" in argv


class ProcessDriver:
    name = "process"
    bind_host = LOOPBACK

    def __init__(self, port: int) -> None:
        self.port = port
        self.base_url = f"http://{LOOPBACK}:{port}"

    def preflight(self) -> list[Check]:
        with socket.socket() as probe:
            probe.settimeout(0.5)
            taken = probe.connect_ex((LOOPBACK, self.port)) == 0
        if taken:
            return [
                Check(
                    "engine_port",
                    CheckStatus.fail,
                    f"{LOOPBACK}:{self.port} is already taken (FLASHGATE_ENGINE_PORT): another engine or program "
                    f"listens there",
                )
            ]
        return [Check("engine_port", CheckStatus.ok, f"{LOOPBACK}:{self.port} is free")]

    def launch(self, command: EngineCommand, log_path: Path) -> EngineHandle:
        # The engine writes its log file itself, not a pipe to the console: it never blocks on a slow reader and
        # can still log (and exit cleanly on SIGTERM) if the console dies under it.
        try:
            with log_path.open("ab") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "engine", "serve", *command.args],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **command.env},
                )
        except OSError as exc:
            raise DriverError(f"could not run {sys.executable} -m engine serve: {exc}") from exc
        return ProcessHandle(proc, log_path)

    def reclaim(self, pid: int | None, container: str | None, grace_s: float) -> str:
        if pid is None or not _is_engine(pid):
            return "its process is gone"
        _signal_group(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while _is_engine(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _is_engine(pid):
            _signal_group(pid, signal.SIGKILL)
            return f"its process {pid} was still running and was killed after {grace_s:.0f} s"
        return f"its process {pid} was still running and was stopped"
