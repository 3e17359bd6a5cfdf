"""Qualification and promotion without an engine: what is refused before anything starts (with the field or the
reason named), the route before any promotion, the roles, the pages, and what a console restart does to a run or
a switch it left unfinished. The runs themselves are in test_qualification.py (slow)."""

from __future__ import annotations

import sqlite3

import pytest
from litestar.testing import TestClient

LADDER = [
    "readiness",
    "smoke",
    "json",
    "tools",
    "streaming_tools",
    "tool_result",
    "responses",
    "needle",
    "post_stress_smoke",
    "client_shapes",
    "performance",
    "vram_reserve",
    "log_scan",
]
MUTATIONS = [
    ("POST", "/api/profiles/cpu-demo/qualifications", {"json": {}}),
    ("POST", "/api/profiles/cpu-demo/decisions", {"json": {"decision": "reject", "reason": "no"}}),
    ("PUT", "/api/route/production", {"json": {"profile": "cpu-demo", "reason": "go"}}),
    ("POST", "/api/route/rollback", {"json": {"reason": "back"}}),
]


def test_the_gate_ladder_is_versioned_and_in_order(client, viewer):
    gates = client.get("/api/gates", headers=viewer).json()
    assert [g["name"] for g in gates] == LADDER
    assert all(g["pass_rule"] and g["measurements"] for g in gates)
    # vram_reserve 2: a reading that lacks one of the engine's GPUs fails (one engine over several GPUs).
    assert {g["name"]: g["version"] for g in gates} == {name: 2 if name == "vram_reserve" else 1 for name in LADDER}
    kinds = {g["name"]: g["kind"] for g in gates}
    assert kinds["smoke"] == "capability" and kinds["readiness"] == kinds["log_scan"] == "structural"
    assert [g["name"] for g in gates if not g["needs_engine"]] == ["vram_reserve", "log_scan"]


@pytest.mark.parametrize(("method", "path", "kwargs"), MUTATIONS, ids=lambda v: str(v))
def test_mutations_need_an_operator(client, viewer, method, path, kwargs):
    assert client.request(method, path, **kwargs).status_code == 401
    refused = client.request(method, path, headers=viewer, **kwargs)
    assert refused.status_code == 403 and "operator" in refused.json()["detail"]


def test_a_run_needs_a_startable_profile(client, operator):
    missing = client.post("/api/profiles/cpu-demo/qualifications", json={}, headers=operator)
    assert missing.status_code == 409
    assert missing.json()["detail"].startswith("cannot qualify 'cpu-demo': weights missing:")
    assert client.post("/api/profiles/nope/qualifications", headers=operator).status_code == 404
    client.post("/api/profiles/maxseq1-1m/retire", headers=operator)
    retired = client.post("/api/profiles/maxseq1-1m/qualifications", json={}, headers=operator)
    assert retired.status_code == 409 and "retired" in retired.json()["detail"]
    assert client.get("/api/profiles/cpu-demo/qualifications", headers=operator).json() == []
    assert client.get("/api/qualifications/999", headers=operator).status_code == 404
    assert client.get("/api/qualifications/999/evidence", headers=operator).status_code == 404


def test_decisions_name_the_field_and_need_a_finished_run(client, operator):
    bad = client.post(
        "/api/profiles/cpu-demo/decisions", json={"decision": "maybe", "reason": ""}, headers=operator
    ).json()
    assert [e["field"] for e in bad["extra"]] == ["decision", "reason"]
    assert "promote, no_promotion, reject" in bad["extra"][0]["message"]
    none = client.post(
        "/api/profiles/cpu-demo/decisions", json={"decision": "no_promotion", "reason": "read it"}, headers=operator
    )
    assert none.status_code == 409 and "no finished qualification run" in none.json()["detail"]
    assert client.get("/api/profiles/cpu-demo/decisions", headers=operator).json() == []


def test_the_route_before_any_promotion(client, operator):
    route = client.get("/api/route", headers=operator).json()
    assert route["production"] is None and route["rollback"] is None
    assert route["challengers"] == route["rejected"] == route["recent"] == [] and route["locked_by"] is None
    assert client.get("/api/route/production", headers=operator).json() is None

    unapproved = client.put("/api/route/production", json={"profile": "cpu-demo", "reason": "go"}, headers=operator)
    assert unapproved.status_code == 409
    assert "'cpu-demo' is not approved: it has no decision" in unapproved.json()["detail"]
    no_reason = client.put("/api/route/production", json={"profile": "cpu-demo"}, headers=operator)
    assert no_reason.status_code == 422 and no_reason.json()["extra"][0]["field"] == "reason"
    unknown = client.put("/api/route/production", json={"profile": "nope", "reason": "go"}, headers=operator)
    assert unknown.status_code == 404

    plan = client.put("/api/route/production", json={"profile": "cpu-demo", "dry_run": True}, headers=operator)
    assert plan.status_code == 200
    body = plan.json()
    assert body["target"] == "cpu-demo" and body["stops"] is None and body["rollback"] is None
    assert not body["allowed"] and not body["starts"]["can_start"]
    assert any("not approved" in r for r in body["refusals"])
    assert any("cannot start now: weights missing" in r for r in body["refusals"])

    for rollback in ({"reason": "back"}, {"dry_run": True}):
        refused = client.post("/api/route/rollback", json=rollback, headers=operator)
        assert refused.status_code == 409 and "no rollback profile" in refused.json()["detail"]
    profiles = client.get("/api/profiles", headers=operator).json()
    assert len(profiles) == 10 and all(p["roles"] == [] for p in profiles)  # the seeds, none with a role


def test_pages_show_roles_qualification_and_the_route(client, operator_token, sign_in):
    sign_in("olga", operator_token("olga", "operator"))
    profile = client.get("/profiles/cpu-demo")
    assert 'id="qualification"' in profile.text and "Not qualified yet." in profile.text
    assert (
        '<button type="submit" class="primary" disabled aria-describedby="qualify-blocked">Qualify</button>'
        in profile.text
    )  # weights missing
    assert "Roles and state" in client.get("/profiles").text
    route = client.get("/route")
    assert route.status_code == 200 and 'id="production-profile"' in route.text and "No switch yet." in route.text
    assert 'hx-get="/route/live"' not in route.text  # nothing to poll: no switch runs
    plan = client.get("/route/plan", params={"plan": "cpu-demo"})
    assert plan.status_code == 200 and "Refused:" in plan.text and "not approved" in plan.text
    assert client.get("/qualifications/999").status_code == 404


def test_a_restart_closes_the_runs_and_switches_left_unfinished(make_app, data_dir, admin):
    with TestClient(make_app()):
        pass
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        profile = conn.execute("SELECT id, content_hash FROM profile WHERE name = 'cpu-demo'").fetchone()
        conn.execute(
            "INSERT INTO qualification_run (profile_id, content_hash, ladder, status, progress, started_at, started_by)"
            " VALUES (?, ?, 'ladder/1', 'running', '{}', '2025-01-01 00:00:00', 'otto')",
            profile,
        )
        conn.execute(
            "INSERT INTO gate_result (run_id, position, gate, version, status, summary, inputs, measurements)"
            " VALUES (1, 0, 'readiness', 1, 'running', '', '{}', '{}')"
        )
        conn.execute(
            "INSERT INTO promotion (kind, target_id, reason, status, steps, started_at, started_by)"
            " VALUES ('promote', ?, 'go', 'running', '[]', '2025-01-01 00:00:00', 'otto')",
            profile[:1],
        )
    with TestClient(make_app()) as client:
        run = client.get("/api/qualifications/1", headers=admin).json()
        assert run["status"] == "aborted" and run["stop_reason"] == "the console restarted while the run was running"
        assert run["gates"][0]["status"] == "not_run" and run["proposal"]["recommendation"] == "none"
        switch = client.get("/api/route/promotions/1", headers=admin).json()
        assert switch["status"] == "failed" and switch["error"] == "the console restarted during the switch"
        assert client.get("/api/profiles/cpu-demo", headers=admin).json()["roles"] == ["challenger"]
        actions = [r["action"] for r in client.get("/api/audit", headers=admin).json()[:2]]
        assert sorted(actions) == ["promotion.failed", "qualification.aborted"]


def test_openapi_lists_the_qualification_and_promotion_api(client):
    paths = client.get("/schema/openapi.json").json()["paths"]
    for path in (
        "/api/gates",
        "/api/profiles/{name}/qualifications",
        "/api/qualifications/{run_id}",
        "/api/qualifications/{run_id}/evidence",
        "/api/profiles/{name}/decisions",
        "/api/route",
        "/api/route/production",
        "/api/route/rollback",
        "/api/route/promotions/{promotion_id}",
    ):
        assert path in paths, path
