"""Qualification and promotion end to end, on a real SQLite file with the real engine as the console's child (the
shipped demo model on CPU), no mocks. The ladder is slow, so each profile is qualified once for the module and the
tests walk one story in order:

A (a 1K child of cpu-demo) is qualified: structural gates pass, capability gates fail with their evidence, which is
stored and exported. Promotion is refused without a passed current run, without confirmation and without waivers,
and allowed with explicit waivers; a second switch meanwhile answers 423. B (A on its own copy of the weights) is
qualified while A serves, so the run drains A, stops it, restores it and records the downtime. B is promoted and
rolled back; then B's weights are corrupted (the fingerprint cannot see it) and a switch to B restores A. Each step
leaves its audit rows."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.support import copy_demo_model, free_port, sign_in

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
A, B = "demo-q1k", "demo-q1k-b"
STRUCTURAL = ("readiness", "post_stress_smoke", "client_shapes", "performance", "log_scan")
CAPABILITY = ("smoke", "json", "tools", "streaming_tools", "tool_result", "responses", "needle")
FINISHED = ("passed", "failed", "aborted")
LADDER_LIMIT_S = 180


@dataclass
class Console:
    client: TestClient
    engine_url: str
    models_dir: Path

    def get(self, path: str, **params) -> dict | list:
        response = self.client.get(path, params=params, headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, path: str, done: Callable[[dict], bool], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not done(body := self.get(path)):
            assert time.monotonic() < deadline, f"{path} not done within {timeout} s: {json.dumps(body)[:3000]}"
            time.sleep(0.25)
        return body

    def qualify(self, profile: str, during: Callable[[], object] | None = None, **body) -> dict:
        """Run the ladder to its end; `during` is called as soon as the run has the engine, its result kept."""
        response = self.client.post(f"/api/profiles/{profile}/qualifications", json=body, headers=ADMIN)
        assert response.status_code == 202, response.text
        started = time.monotonic()
        seen = during() if during is not None else None
        run = self.wait(f"/api/qualifications/{response.json()['id']}", lambda b: b["status"] in FINISHED, 240)
        run["took_s"], run["during"] = time.monotonic() - started, seen
        return run

    def decide(self, profile: str, **body) -> httpx.Response:
        return self.client.post(f"/api/profiles/{profile}/decisions", json=body, headers=ADMIN)

    def switch(self, promotion_id: int) -> dict:
        return self.wait(f"/api/route/promotions/{promotion_id}", lambda b: b["status"] != "running", 120)

    def audit(self, target: str) -> list[str]:
        return [row["action"] for row in reversed(self.get("/api/audit", target=target, limit=500))]

    def engine(self) -> dict:
        return self.get("/api/engine")


def waivers_for(run: dict) -> list[dict]:
    return [
        {"gate": g["name"], "reason": f"the CPU demo model cannot answer {g['name']}: a demo, not an agent"}
        for g in run["gates"]
        if g["status"] == "failed"
    ]


@pytest.fixture(scope="module")
def build() -> Iterator[pytest.MonkeyPatch]:
    """The engine build the runs qualify on (the engine reads FLASHGATE_BUILD before `git describe`, which changes
    with every commit); changed at the end to make the evidence stale."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("FLASHGATE_BUILD", "qualification-test-1")
        yield patch


@pytest.fixture(scope="module")
def console(tmp_path_factory, build) -> Iterator[Console]:
    models = tmp_path_factory.mktemp("q-models")
    copy_demo_model(models)
    copy_demo_model(models, "demo-b")  # B's own copy: the one corrupted later
    port = free_port()
    settings = load_settings(
        {
            "FLASHGATE_DATA_DIR": str(tmp_path_factory.mktemp("q-console") / "data"),
            "FLASHGATE_MODELS_DIR": str(models),
            "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "FLASHGATE_INSTALL_DEMO": "0",
            "FLASHGATE_ENGINE_PORT": str(port),
            "FLASHGATE_ENGINE_GRACE_S": "10",
        }
    )
    with TestClient(create_app(settings)) as client:
        for name, parent, change in ((A, "cpu-demo", {"context_length": 1024}), (B, A, {"model": "demo-b"})):
            created = client.post(
                f"/api/profiles/{parent}/children",
                json={"name": name, "rationale": "the qualification acceptance limits", **change},
                headers=ADMIN,
            )
            assert created.status_code == 201, created.text
        yield Console(client, f"http://127.0.0.1:{port}", models)


@pytest.fixture(scope="module")
def run_a(console: Console) -> dict:
    return console.qualify(A)


@pytest.fixture(scope="module")
def production_a(console: Console, run_a: dict) -> dict:
    """A promoted with a waiver for each failed gate; while the switch runs another one is refused with 423."""
    decided = console.decide(A, decision="promote", reason="demo lane", confirm=A, waivers=waivers_for(run_a))
    assert decided.status_code == 201, decided.text
    locked = console.client.put("/api/route/production", json={"profile": B, "reason": "now"}, headers=ADMIN)
    switch = console.switch(decided.json()["promotion"])
    return {"decision": decided.json(), "switch": switch, "locked": locked}


@pytest.fixture(scope="module")
def run_b(console: Console, production_a: dict) -> dict:
    refused = console.client.post(f"/api/profiles/{B}/qualifications", json={}, headers=ADMIN)

    def operator_commands() -> dict:
        """What an operator meets while the run holds the engine: its Stop, Start and Restart, and the dashboard."""
        sign_in(console.client, "admin", ADMIN_TOKEN)
        return {
            "stop": console.client.post("/api/engine/stop", headers=ADMIN),
            "restart": console.client.post("/api/engine/restart", json={}, headers=ADMIN),
            "start": console.client.post("/api/engine/start", json={"profile": A}, headers=ADMIN),
            "page_stop": console.client.post(
                "/engine/stop",
                headers={"HX-Request": "true", "X-CSRFToken": sign_in(console.client, "admin", ADMIN_TOKEN)},
            ),
            "engine": console.engine(),
            "dashboard": console.client.get("/dashboard/live").text,
        }

    run = console.qualify(B, during=operator_commands, confirm_downtime=True)
    run["refused_without_confirmation"] = refused
    return run


def gate(run: dict, name: str) -> dict:
    return next(g for g in run["gates"] if g["name"] == name)


def test_the_ladder_passes_structural_gates_and_fails_capability_gates_with_evidence(console: Console, run_a: dict):
    assert run_a["status"] == "failed" and run_a["scale"] == "demo" and run_a["stop_reason"] is None
    assert run_a["took_s"] < LADDER_LIMIT_S
    assert [g["name"] for g in run_a["gates"]] == [d["name"] for d in console.get("/api/gates")]
    status = {g["name"]: g["status"] for g in run_a["gates"]}
    assert {name: status[name] for name in STRUCTURAL} == dict.fromkeys(STRUCTURAL, "passed"), status
    assert {name: status[name] for name in CAPABILITY} == dict.fromkeys(CAPABILITY, "failed"), status
    vram = gate(run_a, "vram_reserve")
    assert vram["status"] == "n/a" and vram["summary"].startswith("n/a: no GPU")
    for name in CAPABILITY:
        assert gate(run_a, name)["observations"] >= 1 and gate(run_a, name)["summary"], name
    assert all(g["version"] >= 1 and g["pass_rule"] for g in run_a["gates"])
    assert run_a["progress"]["done"] == run_a["progress"]["total"] == 13

    # Identity: what the evidence is about.
    profile = console.get(f"/api/profiles/{A}")
    assert run_a["content_hash"] == profile["content_hash"] and len(run_a["weights_fingerprint"]) == 64
    info = console.get("/api/engine/runs")[0]["server_info"]
    assert run_a["engine_build"] == info["build"] and not run_a["staleness"]["stale"]
    readiness = gate(run_a, "readiness")["measurements"]
    assert readiness["kv_capacity_tokens"] == info["kv_capacity_tokens"] and readiness["served_ids"] == [A]

    # The scaled ladder: max tokens ≤ 64, a burst of 3, the needle at ~0.75 of the context, claimed from usage.
    assert gate(run_a, "smoke")["inputs"]["max_tokens"] <= 64
    assert gate(run_a, "tools")["inputs"]["concurrent_requests"] == 3 and gate(run_a, "tools")["observations"] == 3
    needle = gate(run_a, "needle")["measurements"]
    assert needle["target_tokens"] == 768 and 0.6 < needle["fraction_of_context"] < 0.8
    assert needle["proven_prompt_tokens"] == needle["prompt_tokens"] != needle["target_tokens"]
    perf = gate(run_a, "performance")["measurements"]
    assert perf["shape"]["planned_context"] == 1024 and perf["completed"] == "3/3"
    assert perf["p50"]["ttfo_s"] > 0 and perf["p50"]["decode_tok_s"] > 0 and perf["p50"]["prefill_tok_s"] > 0
    assert perf["p95"]["e2e_s"] >= perf["p50"]["e2e_s"] > perf["p50"]["ttfo_s"]

    # Capability failures say what came back (the body, whatever the engine's Responses API answers today).
    observations = console.get(f"/api/qualifications/{run_a['id']}/evidence")["observations"]
    answer = next(o["payload"] for o in observations if o["gate"] == "responses")
    assert answer["request"]["path"] == "/v1/responses" and answer["response"]["body"]
    summary = gate(run_a, "responses")["summary"]
    assert (
        summary.startswith(f"HTTP {answer['response']['status']}") or "not 'completed'" in summary or "READY" in summary
    )

    # The proposal is a proposal; the engine was stopped after the run; each step left an audit row.
    assert run_a["proposal"]["recommendation"] == "no_promotion"
    assert set(run_a["proposal"]["failed_gates"]) == set(CAPABILITY) and run_a["decisions"] == []
    assert console.engine()["state"] == "stopped"
    actions = console.audit(f"qualification:{run_a['id']}")
    assert actions == ["qualification.start", *["qualification.gate"] * 13, "qualification.failed"]


def test_evidence_is_stored_per_observation_and_exported(console: Console, run_a: dict):
    bundle = console.get(f"/api/qualifications/{run_a['id']}/evidence")
    assert bundle["schema"] == "flashgate.evidence/v1" and bundle["run"]["id"] == run_a["id"]
    assert [d["name"] for d in bundle["gate_definitions"]] == [g["name"] for g in run_a["gates"]]
    observations = bundle["observations"]
    assert len(observations) == run_a["observations"] == sum(g["observations"] for g in run_a["gates"])
    smoke = next(o["payload"] for o in observations if o["gate"] == "smoke")
    assert smoke["request"]["body"]["messages"][0]["content"].startswith("Write a Python one-liner")
    assert smoke["response"]["status"] == 200 and smoke["usage"]["completion_tokens"] >= 1
    assert smoke["timings"]["seconds"] > 0 and smoke["check"]["problems"]
    needle = next(o["payload"] for o in observations if o["payload"]["observation"] == "needle")
    assert "chars, sha256" in needle["request"]["body"]["messages"][0]["content"]  # the haystack, shortened
    assert any(line.startswith("engine ready:") for line in bundle["engine_run"]["log_tail"])

    # The profile has evidence now: immutable.
    changed = console.client.patch(f"/api/profiles/{A}", json={"max_num_seqs": 2}, headers=ADMIN)
    assert changed.status_code == 409 and "immutable" in changed.json()["detail"]

    # The same bundle as a file, and the readable report with its performance plot.
    page_client = console.client
    sign_in(page_client, "admin", ADMIN_TOKEN)
    download = page_client.get(f"/qualifications/{run_a['id']}/evidence.json")
    assert download.status_code == 200 and "attachment" in download.headers["content-disposition"]
    assert json.loads(download.text)["observations"] == observations
    report = page_client.get(f"/qualifications/{run_a['id']}/report")
    assert report.status_code == 200 and "<svg" in report.text and 'class="bar bar-mine"' in report.text
    assert all(f'id="gate-{g["name"]}"' in report.text for g in run_a["gates"])


def test_promotion_is_refused_without_a_passed_current_run_or_confirmation(console: Console, run_a: dict):
    never = console.decide("cpu-demo", decision="promote", reason="try", confirm="cpu-demo")
    assert never.status_code == 409 and "no finished qualification run" in never.json()["detail"]
    unapproved = console.client.put("/api/route/production", json={"profile": A, "reason": "go"}, headers=ADMIN)
    assert unapproved.status_code == 409 and "not approved" in unapproved.json()["detail"]

    unconfirmed = console.decide(A, decision="promote", reason="go", waivers=waivers_for(run_a))
    assert unconfirmed.status_code == 422
    assert unconfirmed.json()["extra"][0]["field"] == "confirm" and repr(A) in unconfirmed.json()["detail"]
    no_reason = console.decide(A, decision="promote", reason=" ", confirm=A)
    assert no_reason.status_code == 422 and no_reason.json()["extra"][0]["field"] == "reason"

    unwaived = console.decide(A, decision="promote", reason="go", confirm=A, waivers=waivers_for(run_a)[1:])
    assert unwaived.status_code == 409
    assert "smoke failed without a waiver" in unwaived.json()["detail"]
    bad_waivers = [{"gate": "readiness", "reason": "passed anyway"}, {"gate": "smoke", "reason": ""}]
    wrong = console.decide(A, decision="promote", reason="go", confirm=A, waivers=bad_waivers)
    assert wrong.status_code == 422
    assert [e["field"] for e in wrong.json()["extra"]] == ["waivers[0].gate", "waivers[1].reason"]

    plan = console.client.put("/api/route/production", json={"profile": A, "dry_run": True}, headers=ADMIN)
    assert plan.status_code == 200 and not plan.json()["allowed"] and plan.json()["starts"]["can_start"]
    assert console.get("/api/route/production") is None
    # Refusals changed nothing and recorded no decision.
    assert console.get(f"/api/profiles/{A}/decisions") == []
    assert console.get(f"/api/profiles/{A}")["roles"] == ["challenger"]


def test_promotion_with_explicit_waivers_switches_production(console: Console, run_a: dict, production_a: dict):
    decision, switch = production_a["decision"], production_a["switch"]
    assert decision["decision"] == "promote" and decision["operator"] == "admin" and decision["run"] == run_a["id"]
    assert sorted(w["gate"] for w in decision["waivers"]) == sorted(CAPABILITY)
    assert all(w["operator"] == "admin" and w["reason"] for w in decision["waivers"])
    assert production_a["locked"].status_code == 423 and "held by" in production_a["locked"].json()["detail"]

    assert switch["status"] == "committed" and switch["target"] == A and switch["error"] is None
    assert [s["step"] for s in switch["steps"]] == ["stop", "start", "smoke", "commit"]
    assert switch["downtime_s"] > 0
    assert console.get("/api/route/production")["name"] == A
    route = console.get("/api/route")
    assert route["production"] == A and route["rollback"] is None and route["transaction"] is None
    assert console.get(f"/api/profiles/{A}")["roles"] == ["production"]
    engine = console.engine()
    assert engine["state"] == "ready" and engine["profile"] == A

    # The waivers show wherever the decision is: on the run's gates too.
    run = console.get(f"/api/qualifications/{run_a['id']}")
    assert {g["name"] for g in run["gates"] if g["waiver"]} == set(CAPABILITY)
    assert console.audit(f"profile:{A}")[-1] == "decision.promote"
    actions = console.audit(f"promotion:{switch['id']}")
    assert actions == ["promotion.start", *["promotion.step"] * 4, "promotion.committed"]
    assert console.audit("route:production") == ["route.production"]


def test_qualifying_while_production_serves_drains_stops_and_restores_it(console: Console, run_b: dict):
    refused = run_b["refused_without_confirmation"]
    assert refused.status_code == 409 and "confirm_downtime" in refused.json()["detail"]
    assert f"'{A}' (production)" in refused.json()["detail"]
    disruption = run_b["disruption"]
    assert disruption["profile"] == A and disruption["production"] and disruption["drain"]["drained"]
    assert disruption["restored"] and disruption["downtime_s"] > 0
    assert run_b["status"] == "failed" and {g["status"] for g in run_b["gates"]} == {"passed", "failed", "n/a"}
    engine = console.engine()
    assert engine["state"] == "ready" and engine["profile"] == A
    actions = console.audit(f"qualification:{run_b['id']}")
    assert actions[:2] == ["qualification.start", "qualification.displace"]
    assert actions[-2:] == ["qualification.restore", "qualification.failed"]


def test_an_operator_cannot_take_the_engine_from_a_run(console: Console, run_b: dict):
    # An operator's Stop during the run used to be accepted (200): the run died on its own stop and production
    # was never restored. While the run holds the engine, the commands answer 423 naming the holder.
    during = run_b["during"]
    for command in ("stop", "restart", "start"):
        answer = during[command]
        assert answer.status_code == 423, (command, answer.text)
        assert f"the engine is held by qualification of '{B}'" in answer.json()["detail"], command
    assert during["page_stop"].status_code == 423
    assert f"the engine is held by qualification of &#39;{B}&#39;" in during["page_stop"].text
    assert during["engine"]["held_by"].startswith(f"qualification of '{B}' since ")
    assert f"The engine is held by qualification of &#39;{B}&#39;" in during["dashboard"]
    assert 'action="/engine/stop"' not in during["dashboard"]
    assert console.engine()["held_by"] is None


def test_a_second_profile_is_promoted_then_rolled_back(console: Console, run_b: dict):
    decided = console.decide(B, decision="promote", reason="challenger", confirm=B, waivers=waivers_for(run_b))
    assert decided.status_code == 201, decided.text
    switch = console.switch(decided.json()["promotion"])
    assert switch["status"] == "committed" and switch["previous"] == A and switch["restore"] == A
    assert [s["step"] for s in switch["steps"]] == ["drain", "stop", "start", "smoke", "commit"]
    route = console.get("/api/route")
    assert route["production"] == B and route["rollback"]["profile"] == A and route["rollback"]["can_start"]
    assert console.get(f"/api/profiles/{A}")["roles"] == ["rollback"]
    assert console.get(f"/api/profiles/{B}")["roles"] == ["production"]

    plan = console.client.post("/api/route/rollback", json={"dry_run": True}, headers=ADMIN).json()
    assert plan["kind"] == "rollback" and plan["target"] == A and plan["stops"] == B and plan["allowed"]
    assert plan["rollback"]["profile"] == B
    no_reason = console.client.post("/api/route/rollback", json={}, headers=ADMIN)
    assert no_reason.status_code == 422 and no_reason.json()["extra"][0]["field"] == "reason"
    rolled = console.client.post("/api/route/rollback", json={"reason": "B misbehaves"}, headers=ADMIN)
    assert rolled.status_code == 202, rolled.text
    back = console.switch(rolled.json()["id"])
    assert back["status"] == "committed" and back["kind"] == "rollback" and back["target"] == A
    route = console.get("/api/route")
    assert route["production"] == A and route["rollback"] is None
    assert console.engine()["profile"] == A
    again = console.client.post("/api/route/rollback", json={"reason": "again"}, headers=ADMIN)
    assert again.status_code == 409 and "no rollback profile" in again.json()["detail"]


def test_a_target_that_fails_to_start_restores_production(console: Console, run_b: dict):
    # Corrupt B's weights after its qualification without changing any file's size: the fingerprint (names, sizes,
    # tensor headers) cannot see it, so only the switch itself finds out.
    config = console.models_dir / "demo-b" / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"hidden_size": 320', '"hidden_size": 319', 1))
    assert len(config.read_text()) == len(text) and config.read_text() != text
    assert not console.get(f"/api/qualifications/{run_b['id']}")["staleness"]["stale"]

    response = console.client.put("/api/route/production", json={"profile": B, "reason": "retry B"}, headers=ADMIN)
    assert response.status_code == 202, response.text
    switch = console.switch(response.json()["id"])
    assert switch["status"] == "rolled_back" and f"{B} did not start" in switch["error"]
    steps = {s["step"]: s for s in switch["steps"]}
    assert steps["start"]["status"] == "failed" and steps["restore"]["status"] == "ok"
    assert console.get("/api/route")["production"] == A
    engine = console.engine()
    assert engine["state"] == "ready" and engine["profile"] == A
    actions = console.audit(f"promotion:{switch['id']}")
    assert actions[0] == "promotion.start" and actions[-1] == "promotion.rolled_back"
    assert console.audit("route:production") == ["route.production"] * 3  # A, then B, then back to A


def test_reject_is_a_decision_and_a_role(console: Console, run_b: dict):
    rejected = console.decide(B, decision="reject", reason="its weights are broken")
    assert rejected.status_code == 201 and rejected.json()["waivers"] == []
    assert console.get(f"/api/profiles/{B}")["roles"] == ["rejected"]
    assert console.get("/api/route")["rejected"] == [B]
    unapproved = console.client.put("/api/route/production", json={"profile": B, "reason": "x"}, headers=ADMIN)
    assert unapproved.status_code == 409 and "latest decision is reject" in unapproved.json()["detail"]
    listed = {p["name"]: p["roles"] for p in console.get("/api/profiles")}
    assert listed[A] == ["production"] and listed[B] == ["rejected"] and listed["cpu-demo"] == []
    page = console.client.get("/profiles")
    assert 'class="badge role role-production"' in page.text and 'class="badge role role-rejected"' in page.text


def test_an_engine_that_cannot_start_stops_the_ladder_but_not_the_log_scan(console: Console):
    created = console.client.post(
        f"/api/profiles/{A}/children",
        json={
            "name": "demo-q1k-broken",
            "rationale": "an engine arg it refuses",
            "engine_extras": {"shutdown_grace_s": -1},
        },
        headers=ADMIN,
    )
    assert created.status_code == 201, created.text
    run = console.qualify("demo-q1k-broken", confirm_downtime=True)
    assert run["status"] == "aborted" and run["stop_reason"].startswith("the engine did not get ready: ")
    assert "shutdown_grace_s must be >= 0" in gate(run, "readiness")["summary"]
    needs_engine = [g for g in run["gates"] if g["name"] not in ("readiness", "vram_reserve", "log_scan")]
    assert {g["status"] for g in needs_engine} == {"not_run"}
    assert gate(run, "vram_reserve")["status"] == "n/a" and gate(run, "log_scan")["status"] == "failed"
    assert run["proposal"]["recommendation"] == "none"
    # Whatever the decision and its waivers: the run was aborted, not a 422 about the gates it never ran.
    for body in (
        {"decision": "promote", "reason": "try", "confirm": "demo-q1k-broken", "waivers": [{"gate": "tools"}]},
        {"decision": "reject", "reason": "it cannot start"},
    ):
        refused = console.decide("demo-q1k-broken", **body)
        assert refused.status_code == 409 and "was aborted" in refused.json()["detail"], refused.text
    assert run["disruption"]["restored"] and console.engine()["profile"] == A


def test_a_run_that_cannot_restore_production_raises_an_alert(console: Console):
    # Production's weights vanish while a run holds the engine: the run aborts, its restore fails, and the alert says
    # so instead of leaving a route that looks normal with nothing serving it.
    weights, moved = console.models_dir / "demo", console.models_dir / "demo-away"
    try:
        run = console.qualify("demo-q1k-broken", during=lambda: weights.rename(moved), confirm_downtime=True)
    finally:
        moved.rename(weights)
    assert run["status"] == "aborted" and run["disruption"]["profile"] == A
    assert not run["disruption"]["restored"] and "weights" in run["disruption"]["restore_error"]
    alert = console.get("/api/route/alerts")[0]
    assert alert["level"] == "error" and alert["profile"] == A
    assert (
        f"qualification run #{run['id']} stopped '{A}' (production) for its run and could not start it"
        in (alert["message"])
    )
    assert console.audit(f"qualification:{run['id']}")[-2:] == ["qualification.restore_failed", "qualification.aborted"]
    started = console.client.post("/api/engine/start", json={"profile": A}, headers=ADMIN)
    assert started.status_code == 202, started.text
    console.wait("/api/engine", lambda b: b["state"] == "ready", 60)


def test_a_new_engine_build_or_new_weights_make_the_evidence_stale(
    console: Console, run_a: dict, run_b: dict, build: pytest.MonkeyPatch
):
    weights = console.models_dir / "demo-b" / "model.safetensors"
    with weights.open("ab") as f:
        f.write(b"\0")  # a changed size: the fingerprint sees it
    stale_b = console.get(f"/api/qualifications/{run_b['id']}")
    assert stale_b["staleness"]["stale"] and "the weights changed" in stale_b["staleness"]["reasons"][0]
    assert stale_b["proposal"]["recommendation"] == "requalify"

    build.setenv("FLASHGATE_BUILD", "qualification-test-2")
    restarted = console.client.post("/api/engine/restart", json={}, headers=ADMIN)
    assert restarted.status_code == 202, restarted.text
    new_run = restarted.json()["run"]["id"]
    console.wait("/api/engine", lambda b: b["run"]["id"] == new_run and b["state"] == "ready", 60)
    stale_a = console.get(f"/api/qualifications/{run_a['id']}")["staleness"]
    assert stale_a["stale"] and "qualification-test-1" in stale_a["reasons"][0]
    assert "qualification-test-2" in stale_a["reasons"][0]
    plan = console.client.put("/api/route/production", json={"profile": A, "dry_run": True}, headers=ADMIN).json()
    assert not plan["allowed"] and any("stale" in r for r in plan["refusals"])
