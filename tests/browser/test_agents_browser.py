"""The Agents page in a real console process: an operator makes an agent key, sees it once and copies it to the
clipboard with the copy button, then revokes it; a production watch alert heads the dashboard until acknowledged.
No engine runs: the alert row is written the way the watch writes it (test_route.py has the watch raising it)."""

from __future__ import annotations

import sqlite3

from playwright.sync_api import expect

from tests.browser.conftest import ARTIFACTS, BROWSER, sign_in

pytestmark = BROWSER

ALERT = "production 'demo' (engine run #7): crash: the engine exited with exit code -9 (SIGKILL). restart 1 of 3"


def test_make_copy_and_revoke_a_key_and_acknowledge_an_alert(start_console, browser):
    console = start_console(FLASHGATE_MAKE_TINY="0")
    with sqlite3.connect(console.data_dir / "flashgate.sqlite3") as conn:
        conn.execute(
            "INSERT INTO alert (at, level, profile, message) VALUES (datetime('now'), 'warning', 'demo', ?)", (ALERT,)
        )
    context = browser.new_context()
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=console.url)
    page = context.new_page()
    page.goto(f"{console.url}/signin?next=/route/agents")
    sign_in(page)
    expect(page).to_have_url(f"{console.url}/route/agents")
    expect(page.locator("#client-config-unavailable")).to_contain_text("no profile holds the production role")

    page.get_by_label("New key named").fill("pi-laptop")
    page.get_by_role("button", name="Make a key").click()
    issued = page.locator("#issued-key")
    expect(issued).to_contain_text("fg-")
    page.locator("#keys button.copy").click()
    expect(page.locator("#keys button.copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == issued.inner_text().strip()
    page.screenshot(path=str(ARTIFACTS / "agents-key.png"), full_page=True)

    page.once("dialog", lambda dialog: dialog.accept())
    page.locator("#key-pi-laptop").get_by_role("button", name="Revoke").click()
    expect(page.locator("#key-pi-laptop")).to_contain_text("revoked")
    expect(page.locator("#issued-key")).to_have_count(0)  # shown once: gone with the next render

    page.goto(f"{console.url}/dashboard")
    alert = page.locator(".watch-alert")
    expect(alert).to_contain_text("restart 1 of 3")
    page.screenshot(path=str(ARTIFACTS / "dashboard-alert.png"), full_page=True)
    alert.get_by_role("button", name="Acknowledge").click()
    expect(page.locator(".watch-alert")).to_have_count(0)
    context.close()
