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
    console = start_console(FLASHGATE_INSTALL_DEMO="0")
    with sqlite3.connect(console.data_dir / "flashgate.sqlite3") as conn:
        conn.execute(
            "INSERT INTO alert (at, level, profile, message) VALUES (datetime('now'), 'warning', 'demo', ?)", (ALERT,)
        )
        # Sixty rows by a drill, for the audit page's paging.
        conn.executemany(
            "INSERT INTO audit (at, actor, action, target) VALUES (datetime('now'), 'drill', 'drill.step', ?)",
            [(f"drill:{i}",) for i in range(60)],
        )
    context = browser.new_context()
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=console.url)
    page = context.new_page()
    # The setup link once the admin exists: the sign-in page says why it is back there.
    page.goto(f"{console.url}/signin")
    expect(page.locator("link[rel=icon]")).to_have_attribute("href", "/static/favicon.svg")
    assert page.request.get(f"{console.url}/static/favicon.svg").ok
    expect(page.get_by_text("the operator is admin and the token is that variable's value")).to_be_visible()
    page.get_by_role("link", name="Exchange the setup token").click()
    expect(page.locator("#setup-done")).to_contain_text("The first admin already exists")
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

    # A path that is no page is a page that says so, not JSON; the API's stays JSON.
    page.goto(f"{console.url}/no-such-page")
    expect(page.get_by_role("heading", name="404")).to_be_visible()
    expect(page.locator("main")).to_contain_text("there is no page at /no-such-page")
    expect(page.get_by_role("link", name="Back to the dashboard")).to_be_visible()
    assert page.request.get(f"{console.url}/api/no-such-thing").json()["status_code"] == 404

    # The audit page pages and filters.
    page.goto(f"{console.url}/audit")
    expect(page.locator("table.audit tbody tr")).to_have_count(50)
    page.locator("#audit-older").click()
    expect(page.locator("table.audit tbody tr").first).to_be_visible()
    assert "before=" in page.url
    page.get_by_label("Action").fill("key")
    page.get_by_role("button", name="Filter").click()
    rows = page.locator("table.audit tbody tr")
    expect(rows).to_have_count(2)  # the key made, then revoked
    expect(rows.first).to_contain_text("key.revoke")
    page.get_by_label("Action").fill("")
    page.get_by_label("Who").fill("drill")
    page.get_by_role("button", name="Filter").click()
    expect(rows).to_have_count(50)
    page.locator("#audit-older").click()
    expect(rows).to_have_count(10)
    expect(page.locator("#audit-older")).to_have_count(0)
    page.screenshot(path=str(ARTIFACTS / "audit-filtered.png"), full_page=True)
    context.close()
