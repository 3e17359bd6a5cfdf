"""A real console process for the browser tests, and Debian's chromium driven through Playwright."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import ROOT, free_port, start_console

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
# Every browser test module's marks.
BROWSER = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (make browser-deps)"
    ),
]


def sign_in(page) -> None:
    """On the sign-in page: sign in as the admin."""
    page.get_by_label("Operator").fill("admin")
    page.get_by_label("Token").fill(ADMIN_TOKEN)
    page.get_by_role("button", name="Sign in").click()


@dataclass(frozen=True)
class ConsoleProcess:
    url: str
    engine_port: int
    data_dir: Path


@pytest.fixture(name="start_console")
def start_console_fixture(tmp_path) -> Iterator[Callable[..., ConsoleProcess]]:
    """Start `python -m app` on a fresh data directory with the given extra settings; stopped after the test."""
    procs = []

    def start(**settings: str) -> ConsoleProcess:
        port, engine_port = free_port(), free_port()
        data_dir = tmp_path / "data"
        env = {
            "FLASHGATE_DATA_DIR": str(data_dir),
            "FLASHGATE_PORT": str(port),
            "FLASHGATE_ENGINE_PORT": str(engine_port),
            "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            **settings,
        }
        procs.append(start_console(env, tmp_path / "console.log"))
        return ConsoleProcess(f"http://127.0.0.1:{port}", engine_port, data_dir)

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
