"""What the console, browser, packaging, API and route tests share: free ports, waiting on a process or its output,
the console as a real process (`python -m app`), signing in through the console's form, and the shipped demo model
in a models directory."""

from __future__ import annotations

import os
import queue
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL_DIR = ROOT / "engine" / "demo_model"


def copy_demo_model(models_dir: Path, name: str = "demo") -> Path:
    """The shipped demo model (engine/demo_model) as the console installs it: each file SHA256SUMS names, and
    SHA256SUMS itself, into `models_dir / name`. A console whose models directory holds it as `demo` installs nothing
    more."""
    target = models_dir / name
    target.mkdir(parents=True)
    sums = (DEMO_MODEL_DIR / "SHA256SUMS").read_text()
    for file in [line.split(maxsplit=1)[1] for line in sums.splitlines()] + ["SHA256SUMS"]:
        shutil.copyfile(DEMO_MODEL_DIR / file, target / file)
    return target


def free_port() -> int:
    """A free port below the ephemeral range: a port the engine binds only later must not be taken meanwhile as the
    local end of some outgoing connection (which picks from the ephemeral range)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(10_000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port


def wait_until(
    check: Callable[[], bool],
    what: str,
    timeout: float = 60,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
) -> None:
    """Poll `check` until it holds (a refused connection counts as not yet); fails as soon as `proc` exits, with the
    end of its log."""

    def output() -> str:
        return log.read_text()[-4000:] if log is not None else ""

    deadline = time.monotonic() + timeout
    while True:
        assert proc is None or proc.poll() is None, f"exited with {proc.returncode} before {what}:\n{output()}"
        try:
            if check():
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"not {what} within {timeout} s:\n{output()}"
        time.sleep(0.2)


def terminate(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then its exit code; a process still there after the timeout is killed (and the timeout raised)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class OutputLines:
    """A process's stdout, read on a thread: the lines read so far, and waiting for one."""

    def __init__(self, proc: subprocess.Popen, log: Path | None = None) -> None:
        # `log`: where the process writes its other output, shown when a wait fails (else the lines read).
        self.proc, self.log = proc, log
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))

    def _output(self) -> str:
        return self.log.read_text() if self.log is not None else "\n".join(self.lines)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float) -> str:
        """The first line that matches; fails when the process ends or the time is up first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self._queue.get(timeout=0.1)
            except queue.Empty:
                # Output ends only when the process has exited and every line has been read.
                assert self._reader.is_alive(), f"exited with {self.proc.poll()}:\n{self._output()}"
                continue
            self.lines.append(line)
            if predicate(line):
                return line
        raise AssertionError(f"nothing matched within {timeout} s:\n{self._output()}")


def start_console(settings: dict[str, str | None], log: Path, timeout: float = 60) -> subprocess.Popen:
    """`python -m app` with these FLASHGATE_* settings over the test's environment (None unsets one), its output
    appended to `log`; returns once /readyz answers."""
    env = {**os.environ, **settings}
    env = {name: value for name, value in env.items() if value is not None}
    with log.open("a") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    ready = f"http://127.0.0.1:{env['FLASHGATE_PORT']}/readyz"
    wait_until(lambda: httpx.get(ready, timeout=1).status_code == 200, "ready", timeout, proc, log)
    return proc


def form_csrf(page: str) -> str:
    """The CSRF token a console page embeds in its forms (its cookie came with the page)."""
    return page.split('name="_csrf_token" value="')[1].split('"')[0]


def sign_in(client: httpx.Client, name: str, token: str) -> str:
    """Sign in through the console's form (a TestClient is an httpx client too), leaving the session cookie on the
    client; returns the CSRF token."""
    csrf = form_csrf(client.get("/signin").text)
    response = client.post("/signin", data={"name": name, "token": token, "_csrf_token": csrf}, follow_redirects=False)
    assert response.status_code == 303, response.text
    return csrf
