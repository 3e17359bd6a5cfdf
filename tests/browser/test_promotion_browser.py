"""An operator qualifies and promotes in a real console process with the real engine (the shipped demo model the
console installs on first start). The setup, through the API, qualifies A and promotes it with waivers, then starts
B's run (which drains A, stops it and restores it afterwards). In the browser the operator watches B's run live,
reads the proposal, approves B with a waiver per failed gate, sees the roles change, and rolls back to A.
Screenshots land in test-artifacts/."""

from __future__ import annotations

import re
import time

import httpx
from playwright.sync_api import expect

from tests.browser.conftest import ADMIN_TOKEN, ARTIFACTS, BROWSER, sign_in

pytestmark = BROWSER

A, B = "demo-1k", "demo-1k-2seqs"
FINISHED = re.compile("passed|failed|aborted")


def _wait(api: httpx.Client, path: str, done, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while not done(body := api.get(path).json()):
        assert time.monotonic() < deadline, f"{path} not done within {timeout} s: {str(body)[:2000]}"
        time.sleep(0.5)
    return body


def _waivers(run: dict) -> list[dict]:
    return [{"gate": g["name"], "reason": "a toy model"} for g in run["gates"] if g["status"] == "failed"]


def test_watch_a_run_approve_it_with_waivers_and_roll_back(start_console, browser):
    console = start_console(FLASHGATE_BUILD="browser-test-build", FLASHGATE_TELEMETRY_INTERVAL_S="1")
    url = console.url
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30)
    _wait(api, "/api/engine", lambda b: b["demo_checkpoint"]["state"] == "present", 90)
    for name, parent, change in ((A, "cpu-demo", {"context_length": 1024}), (B, A, {"max_num_seqs": 2})):
        created = api.post(f"/api/profiles/{parent}/children", json={"name": name, "rationale": "demo", **change})
        assert created.status_code == 201, created.text
    run_a = api.post(f"/api/profiles/{A}/qualifications", json={}).json()
    run_a = _wait(api, f"/api/qualifications/{run_a['id']}", lambda b: FINISHED.fullmatch(b["status"]), 150)
    decided = api.post(
        f"/api/profiles/{A}/decisions",
        json={"decision": "promote", "reason": "the demo lane", "confirm": A, "waivers": _waivers(run_a)},
    )
    assert decided.status_code == 201, decided.text
    switch = decided.json()["promotion"]
    _wait(api, f"/api/route/promotions/{switch}", lambda b: b["status"] != "running", 60)
    run_b = api.post(f"/api/profiles/{B}/qualifications", json={"confirm_downtime": True})
    assert run_b.status_code == 202, run_b.text
    run_b = run_b.json()

    page = browser.new_page(viewport={"width": 1440, "height": 1000})
    page.set_default_timeout(30_000)
    page.goto(f"{url}/signin?next=/qualifications/{run_b['id']}")
    sign_in(page)
    expect(page).to_have_url(f"{url}/qualifications/{run_b['id']}")

    # Watch progress: the gate, its step and the time move without a reload.
    page.evaluate("window.flashgateNotReloaded = true")
    try:
        expect(page.locator("#progress")).to_contain_text("Gate ", timeout=60_000)
    except AssertionError as error:  # a run that ended before its first gate: say why it ended
        run = api.get(f"/api/qualifications/{run_b['id']}").json()
        gates = {g["name"]: (g["status"], g.get("summary")) for g in run["gates"]}
        raise AssertionError(f"run B is {run['status']}, gates {gates}") from error
    expect(page.locator(".gate-row.gate-passed").first).to_be_visible(timeout=60_000)
    page.screenshot(path=str(ARTIFACTS / "qualification-progress.png"), full_page=True)
    expect(page.locator("#run-live")).to_have_attribute("data-status", FINISHED, timeout=150_000)
    assert page.evaluate("window.flashgateNotReloaded") is True

    # Read the proposal: structural gates passed, capability gates failed with what came back.
    proposal = page.locator("#proposal")
    expect(proposal).to_contain_text("No promotion")
    expect(page.locator("#gate-responses .gate-status")).to_have_text("failed")
    expect(page.locator("#gate-post_stress_smoke .gate-status")).to_have_text("passed")
    page.screenshot(path=str(ARTIFACTS / "qualification-proposal.png"), full_page=True)

    # Promote without waivers first: the refusal shows where the operator is, at the form, and marks each failed
    # gate that lacks a waiver.
    form = page.locator("#decision-form")
    form.get_by_label("Promote").check()
    form.locator("#d-reason").fill("B halves max_num_seqs; the demo model cannot answer agents either way")
    form.locator("#d-confirm").fill(B)
    form.get_by_role("button", name="Record decision").click()
    refusal = page.locator("#decision-refusal")
    expect(refusal).to_contain_text("failed without a waiver")
    expect(refusal).to_be_in_viewport()
    expect(page.locator("#notice")).to_be_empty()
    failed = [
        g["name"] for g in api.get(f"/api/qualifications/{run_b['id']}").json()["gates"] if g["status"] == "failed"
    ]
    assert len(failed) > 1
    for gate in failed:
        expect(page.locator(f"#waiver-{gate}.invalid")).to_contain_text("has no waiver")
    page.screenshot(path=str(ARTIFACTS / "qualification-decision-refused.png"), full_page=True)

    # Every waiver but the last with its reason: the error names that gate, and the refusal before it is gone.
    for gate in failed:
        form.locator(f"#waive-{gate}").check()
    for gate in failed[:-1]:
        form.locator(f"#waiver-reason-{gate}").fill(f"{gate}: a toy CPU model, not an agent")
    form.get_by_role("button", name="Record decision").click()
    expect(page.locator(f"#waiver-{failed[-1]} .error")).to_contain_text(f"the waiver of '{failed[-1]}' needs a reason")
    expect(page.locator("#decision-refusal")).to_have_count(0)
    expect(page.locator("#decision-form .waiver.invalid")).to_have_count(1)

    # Approve with a waiver per failed gate, typing the profile's name.
    form.locator(f"#waiver-reason-{failed[-1]}").fill(f"{failed[-1]}: a toy CPU model, not an agent")
    page.screenshot(path=str(ARTIFACTS / "qualification-decision.png"), full_page=True)
    form.get_by_role("button", name="Record decision").click()

    # The switch runs on the route page; the roles change when it commits.
    expect(page).to_have_url(f"{url}/route")
    expect(page.locator("#production-profile")).to_have_text(B, timeout=60_000)
    expect(page.locator("#rollback-profile")).to_have_text(A)
    expect(page.locator(".role-rollback")).to_contain_text("can start now")
    expect(page.locator(".switches tbody tr").first).to_contain_text("committed")
    page.screenshot(path=str(ARTIFACTS / "route-promoted.png"), full_page=True)
    page.goto(f"{url}/profiles")
    expect(page.locator("tr", has_text=B).locator(".role-production")).to_be_visible()
    expect(page.locator("tr", has_text=f"{A} ").locator(".role-rollback")).to_be_visible()
    page.screenshot(path=str(ARTIFACTS / "profiles-roles.png"), full_page=True)

    # The report reads the same evidence, with the performance plot against production on the same shape.
    page.goto(f"{url}/qualifications/{run_b['id']}/report")
    expect(page.locator("figure.bar-chart svg").first).to_be_visible()
    expect(page.locator("#gate-tools")).to_contain_text("waived")
    page.screenshot(path=str(ARTIFACTS / "qualification-report.png"))
    page.locator("#performance").screenshot(path=str(ARTIFACTS / "qualification-report-performance.png"))

    # Roll back to the last known good.
    page.goto(f"{url}/route")
    page.on("dialog", lambda dialog: dialog.accept())
    page.get_by_label("Reason for the rollback").fill("B was only a drill")
    page.get_by_role("button", name=f"Roll back to {A}").click()
    expect(page.locator("#production-profile")).to_have_text(A, timeout=60_000)
    expect(page.locator("#rollback-profile")).to_have_text("none")
    expect(page.locator("#rollback-none")).to_have_text(
        f"The last rollback used it. The next promotion over {A} makes {A} the rollback."
    )
    expect(page.locator(".switches tbody tr").first).to_contain_text("rollback")
    page.screenshot(path=str(ARTIFACTS / "route-rolled-back.png"), full_page=True)
    engine = api.get("/api/engine").json()
    assert engine["state"] == "ready" and engine["profile"] == A

    # A stream through the route says its type once; the Agents page's latency quantiles are no looser than the
    # slowest request.
    key = api.post("/api/keys", json={"name": "drill"}).json()["key"]
    chat = {"model": "deepseek-v4-flash", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=chat | {"stream": True}, headers={"Authorization": f"Bearer {key}"}
    ) as stream:
        assert stream.status_code == 200 and stream.headers["content-type"] == "text/event-stream; charset=utf-8"
        stream.read()
    page.goto(f"{url}/route/agents")
    row = page.locator("#usage-key tr", has_text="drill")
    cells = [float(row.locator("td").nth(i).inner_text().split()[0]) for i in (4, 5, 6)]
    assert cells[0] <= cells[2] and cells[1] <= cells[2], cells

    # A run whose engine cannot start is aborted: it proposes nothing and offers no decision, and the API refuses
    # one with 409 "was aborted" rather than a 422 about the gates it never ran.
    created = api.post(
        f"/api/profiles/{A}/children",
        json={
            "name": "demo-broken",
            "rationale": "an option the engine refuses",
            "engine_extras": {"shutdown_grace_s": -1},
        },
    )
    assert created.status_code == 201, created.text
    broken = api.post("/api/profiles/demo-broken/qualifications", json={"confirm_downtime": True}).json()
    page.goto(f"{url}/qualifications/{broken['id']}")
    expect(page.locator("#run-live")).to_have_attribute("data-status", "aborted", timeout=90_000)
    expect(page.locator("#proposal .badge.rec")).to_have_text("No proposal")
    expect(page.locator("#decision-aborted")).to_contain_text("This run was aborted, so it decides nothing")
    expect(page.locator("#decision-form")).to_have_count(0)
    page.screenshot(path=str(ARTIFACTS / "qualification-aborted.png"), full_page=True)
    refused = api.post(
        "/api/profiles/demo-broken/decisions",
        json={"decision": "promote", "reason": "x", "confirm": "demo-broken", "waivers": [{"gate": "tools"}]},
    )
    assert refused.status_code == 409 and "was aborted" in refused.json()["detail"], refused.text
