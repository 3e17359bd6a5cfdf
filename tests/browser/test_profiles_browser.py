"""An operator in a real browser: sign in to the real console process, open cpu-demo, make a child with another
context length through the htmx form, and find it in the profile list."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
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

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (make browser-deps)"
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def console_url(tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "FLASHGATE_DATA_DIR": str(tmp_path / "data"),
        "FLASHGATE_PORT": str(port),
        "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
    }
    log = tmp_path / "console.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"console exited early:\n{log.read_text()}"
            try:
                httpx.get(f"{url}/readyz", timeout=1).raise_for_status()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "console did not get ready within 60 s"
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def test_make_a_child_of_cpu_demo_in_the_browser(console_url):
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.set_default_timeout(10_000)
            page.goto(f"{console_url}/profiles")
            expect(page).to_have_url(f"{console_url}/signin?next=/profiles")
            page.get_by_label("Operator").fill("admin")
            page.get_by_label("Token").fill(ADMIN_TOKEN)
            page.get_by_role("button", name="Sign in").click()
            expect(page.get_by_role("heading", name="Profiles")).to_be_visible()
            expect(page.get_by_role("row", name="cpu-demo")).to_contain_text("weights missing")

            page.get_by_role("link", name="cpu-demo", exact=True).click()
            expect(page.get_by_role("heading", name="cpu-demo")).to_be_visible()
            page.get_by_role("link", name="Make a child").click()

            # A mistake first: the error shows beside its field, the form stays.
            page.get_by_label("Name").fill("cpu-demo-2k")
            page.locator("#f-context_length").fill("999999999")
            page.get_by_role("button", name="Create child").click()
            expect(page.locator("#error-rationale")).to_contain_text("rationale is required")
            expect(page.locator("#error-context_length")).to_contain_text("at most 1048576")
            page.screenshot(path=str(ARTIFACTS / "profiles-child-form-errors.png"), full_page=True)

            page.get_by_label("Rationale").fill("Half the context: does the demo answer faster?")
            page.locator("#f-context_length").fill("2048")
            page.get_by_role("button", name="Create child").click()
            expect(page).to_have_url(f"{console_url}/profiles/cpu-demo-2k")
            expect(page.locator("table.diff")).to_contain_text("context_length")
            expect(page.locator("table.diff .after")).to_have_text("2048")
            page.screenshot(path=str(ARTIFACTS / "profiles-child-detail.png"), full_page=True)

            page.get_by_role("navigation", name="Main").get_by_role("link", name="Profiles").click()
            row = page.get_by_role("row", name="cpu-demo-2k")
            expect(row).to_contain_text("2,048")
            expect(row).to_contain_text("cpu-demo")
            page.screenshot(path=str(ARTIFACTS / "profiles-list.png"), full_page=True)
        finally:
            browser.close()
