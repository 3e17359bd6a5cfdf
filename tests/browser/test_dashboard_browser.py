"""An operator runs the engine from the dashboard of a real console process: the console installs the shipped demo
model on first start, the operator makes a child of cpu-demo with another context length, starts the engine with it
and watches the KV capacity appear (the page is never reloaded), sees the history fill while requests run, and stops
it. Screenshots land in test-artifacts/."""

from __future__ import annotations

import threading

import httpx
from playwright.sync_api import expect

from tests.browser.conftest import ADMIN_TOKEN, ARTIFACTS, BROWSER, sign_in

pytestmark = BROWSER
API = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def _requests(engine: str, stop: threading.Event) -> None:
    """Traffic for the throughput and KV-usage history, straight to the engine."""
    with httpx.Client(timeout=30) as client:
        while not stop.is_set():
            client.post(
                f"{engine}/v1/completions",
                json={"model": "cpu-demo-1k", "prompt": "The quick brown fox " * 40, "max_tokens": 48},
            )


def test_start_watch_and_stop_the_engine_from_the_dashboard(start_console, browser):
    console = start_console(FLASHGATE_TELEMETRY_INTERVAL_S="1")
    url = console.url
    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(30_000)
    errors = []
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.goto(f"{url}/")
    sign_in(page)
    expect(page).to_have_url(f"{url}/dashboard")
    expect(page.locator(".engine-head")).to_contain_text("no engine has run yet")

    page.goto(f"{url}/profiles/cpu-demo/child")
    page.get_by_label("Name").fill("cpu-demo-1k")
    page.get_by_label("Rationale").fill("A quarter of the context: how much KV does the demo really need?")
    page.locator("#f-context_length").fill("1024")
    page.get_by_role("button", name="Create child").click()
    expect(page).to_have_url(f"{url}/profiles/cpu-demo-1k")

    page.get_by_role("navigation", name="Main").get_by_role("link", name="Dashboard").click()
    # The console installs the demo model in the background; the profile becomes startable when it is there.
    option = page.locator('#start-profile option[value="cpu-demo-1k"]')
    expect(option).to_be_enabled(timeout=90_000)
    page.evaluate("window.flashgateNotReloaded = true")
    page.locator("#start-profile").select_option("cpu-demo-1k")
    page.get_by_role("button", name="Start").click()
    expect(page.locator(".engine-head .badge")).to_have_text("starting")
    page.screenshot(path=str(ARTIFACTS / "dashboard-starting.png"), full_page=True)

    capacity = page.locator("#kv-capacity")
    expect(page.locator(".engine-head .badge")).to_have_text("ready", timeout=90_000)
    info = httpx.get(f"http://127.0.0.1:{console.engine_port}/server_info", timeout=5).json()
    expect(capacity).to_have_text(f"{info['kv_capacity_tokens']:,}")
    assert info["config"]["context_length"] == 1024
    assert page.evaluate("window.flashgateNotReloaded") is True  # it appeared live, by htmx, without a reload

    # The boot timeline in the operator's words: no "None", no GPU memory on a CPU host, and the weights' bar as
    # long as the engine says the stage took, not the whole time since the launch.
    timeline = page.locator("#engine-live .card", has=page.locator(".timeline"))
    expect(timeline).to_contain_text("on the CPU (no GPU memory)")
    assert "None" not in timeline.inner_text() and "0.0 GiB" not in timeline.inner_text()
    stages = {
        s["stage"]: s for s in httpx.get(f"{url}/api/engine", headers=API, timeout=5).json()["run"]["boot_stages"]
    }
    total = max(s["after_s"] for s in stages.values())
    style = page.locator(".stage-weights .stage-bar span").get_attribute("style")
    width = float(style.split("width:")[1].strip(" %;"))
    assert abs(width - 100 * stages["weights"]["seconds"] / total) < 1.0, (style, stages)
    # The engine's prefix-cache counters: n/a until a prompt has been looked up (never a 0 % of nothing).
    prefix_cache = page.locator("#prefix-cache")
    if "n/a" in prefix_cache.inner_text():
        expect(prefix_cache).to_contain_text("no prompt looked up yet")

    stop = threading.Event()
    traffic = threading.Thread(target=_requests, args=(f"http://127.0.0.1:{console.engine_port}", stop))
    traffic.start()
    try:
        expect(page.locator(".chart").nth(1).locator("figcaption strong")).not_to_have_text("n/a", timeout=20_000)
        expect(prefix_cache).to_contain_text("prompt tokens looked up", timeout=20_000)  # a share of them, in %
        page.wait_for_timeout(6_000)
        page.screenshot(path=str(ARTIFACTS / "dashboard-ready.png"), full_page=True)
    finally:
        stop.set()
        traffic.join(timeout=60)

    # Polling while the engine runs raised no console error (the start form's select is gone then), and the
    # console's log is not a line per /health poll.
    assert errors == [], errors
    log = (console.data_dir.parent / "console.log").read_text()
    assert "/health" not in log and '"console_sign_in"' in log

    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_role("button", name="Stop").click()
    expect(page.locator(".engine-head .badge")).to_have_text("stopped")
    expect(capacity).to_have_text("—")
    expect(page.locator("#start-profile")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "dashboard-stopped.png"), full_page=True)

    page.locator(".engine-meta").get_by_role("link", name="logs").click()
    expect(page.locator("pre.log")).to_contain_text("engine ready: context_len=1024")
    page.screenshot(path=str(ARTIFACTS / "engine-run-log.png"), full_page=True)
