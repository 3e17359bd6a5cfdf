"""A real console process for the browser tests, and Debian's chromium driven through Playwright."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts"
ADMIN_TOKEN = "fg_browser-test-admin"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


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


@dataclass(frozen=True)
class ConsoleProcess:
    url: str
    engine_port: int
    data_dir: Path


@pytest.fixture
def start_console(tmp_path) -> Iterator[Callable[..., ConsoleProcess]]:
    """Start `python -m app` on a fresh data directory with the given extra settings; stopped after the test."""
    procs: list[subprocess.Popen] = []

    def start(**settings: str) -> ConsoleProcess:
        port, engine_port = free_port(), free_port()
        data_dir = tmp_path / "data"
        env = {
            **os.environ,
            "FLASHGATE_DATA_DIR": str(data_dir),
            "FLASHGATE_PORT": str(port),
            "FLASHGATE_ENGINE_PORT": str(engine_port),
            "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            **settings,
        }
        log = tmp_path / "console.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"console exited early:\n{log.read_text()}"
            try:
                httpx.get(f"{url}/readyz", timeout=1).raise_for_status()
                return ConsoleProcess(url, engine_port, data_dir)
            except httpx.TransportError:
                assert time.monotonic() < deadline, "console did not get ready within 60 s"
                time.sleep(0.2)

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def browser():
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()
