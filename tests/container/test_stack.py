"""The default stack as a CPU operator runs it (`docker compose up -d`, compose.yaml alone), from the image built
with no network: healthy, signed in, the engine started inside the console's container by a switch of the route,
one chat completion through the route with an agent key (the official openai client); then `down` and `up` again,
and the profiles, keys and evidence are still in the volume. The container runs as the image's non-root user."""

from __future__ import annotations

import openai
import pytest

from tests.container.conftest import ADMIN, ADMIN_TOKEN, Stack, wait
from tests.support import sign_in

pytestmark = pytest.mark.container

PROFILE = "container-demo"

# A passed qualification run and a promote decision on the profile's current content, as an operator's would be
# (the route tests do the same): the route serves only a promoted profile, and a qualification is not this test's
# subject. Run inside the container, as its user, against the volume's database.
APPROVE = """
import sqlite3, sys
with sqlite3.connect("/data/flashgate.sqlite3") as conn:
    profile_id, content_hash = conn.execute(
        "SELECT id, content_hash FROM profile WHERE name = ?", (sys.argv[1],)).fetchone()
    run_id = conn.execute(
        "INSERT INTO qualification_run (profile_id, content_hash, ladder, scale, status, progress, started_at,"
        " started_by, finished_at) VALUES (?, ?, 'ladder/1', 'demo', 'passed', '{}', datetime('now'), 'test',"
        " datetime('now'))", (profile_id, content_hash)).lastrowid
    conn.execute(
        "INSERT INTO decision (profile_id, run_id, decision, reason, operator, content_hash, created_at)"
        " VALUES (?, ?, 'promote', 'container test', 'admin', ?, datetime('now'))",
        (profile_id, run_id, content_hash))
"""


def _agent(stack: Stack, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key, max_retries=0, timeout=120)


def _ask(stack: Stack, key: str) -> str:
    answer = _agent(stack, key).chat.completions.create(
        model="deepseek-v4-flash", messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0
    )
    assert answer.model == "deepseek-v4-flash" and answer.choices[0].message.content
    return answer.choices[0].message.content


def test_default_stack_serves_through_the_route_and_keeps_its_volume(make_stack):
    stack = make_stack("flashgate-ci", ["compose.yaml"])
    stack.compose("up", "-d")
    console = stack.wait_healthy()

    # The image's non-root user, and the console published on loopback only.
    assert stack.inspect(console, "{{.Config.User}}") == "10001:10001"
    assert stack.exec(console, "id", "-u").strip() == "10001"
    bindings = stack.inspect(console, '{{range (index .NetworkSettings.Ports "8080/tcp")}}{{.HostIp}} {{end}}')
    assert bindings.split() == ["127.0.0.1"]
    assert stack.inspect(console, "{{.HostConfig.ShmSize}}") == str(2**30)

    sign_in(stack.http, "admin", ADMIN_TOKEN)
    assert stack.http.get("/dashboard").status_code == 200  # the session, not a redirect to /signin
    created = stack.http.post(
        "/api/profiles/cpu-demo/children",
        json={"name": PROFILE, "rationale": "the container test's production", "max_output_tokens": 16},
        headers=ADMIN,
    )
    assert created.status_code == 201, created.text
    stack.exec(console, "python", "-", PROFILE, stdin=APPROVE)
    key = stack.http.post("/api/keys", json={"name": "container-ci"}, headers=ADMIN)
    assert key.status_code == 201, key.text
    agent_key = key.json()["key"]

    # The switch starts the engine inside the console's container (the process driver) and gives it the route.
    switch = stack.http.put(
        "/api/route/production", json={"profile": PROFILE, "reason": "container test"}, headers=ADMIN
    )
    assert switch.status_code == 202, switch.text
    promotion = f"/api/route/promotions/{switch.json()['id']}"
    wait(lambda: stack.get(promotion)["status"] != "running", "switched", 300, stack)
    assert stack.get(promotion)["status"] == "committed", stack.get(promotion)
    engine = stack.get("/api/engine")
    assert engine["state"] == "ready" and engine["run"]["profile"] == PROFILE, engine
    # The engine is the console's child in the same container, as the same non-root user.
    assert stack.exec(console, "stat", "-c", "%u", f"/proc/{engine['run']['pid']}").strip() == "10001"
    _ask(stack, agent_key)
    runs = [run["id"] for run in stack.get("/api/engine/runs")]

    stack.compose("down", "--timeout", "60")
    assert stack.compose("ps", "-q").split() == []
    stack.compose("up", "-d")
    stack.wait_healthy()

    assert PROFILE in {p["name"] for p in stack.get("/api/profiles")}
    keys = {k["name"]: k for k in stack.get("/api/keys")}
    assert keys["container-ci"]["requests"] >= 1 and not keys["container-ci"]["revoked_at"]
    assert set(runs) <= {run["id"] for run in stack.get("/api/engine/runs")}
    actions = {entry["action"] for entry in stack.get("/api/audit")}
    assert {"engine.start", "engine.ready"} <= actions, actions
    # Production comes back serving on its own (FLASHGATE_RESUME_PRODUCTION), to the same key.
    wait(lambda: stack.get("/api/engine")["state"] == "ready", "production resumed", 300, stack)
    _ask(stack, agent_key)
