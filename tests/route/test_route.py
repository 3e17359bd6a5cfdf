"""The agent route end to end: a real console process (`python -m app`) on a real SQLite file, its real engine
children on the shipped demo model, and the official `openai` client against the console's `/v1`. One story, in order:

A (limit 16 output tokens) is promoted; through the route with a key, answers equal the engine's own (whole and
streamed; chat, completions, Responses) under the alias; no key, a revoked key or an operator token get 401; budgets
are clamped with a `Warning`. A switch to B (limit 1000) answers 503 with `Retry-After` until B answers under the
same alias. B's engine is killed in the middle of a stream: the agent gets an error event, and the watch restarts
B. Then B hangs (SIGSTOP): the second failure within the window rolls back to A, and the alert is on the dashboard.
Last, the console restarts (SIGTERM, then a new process on the same database): A serves again by itself; stopped by
an operator first, it stays stopped across the next restart.

Qualification is not under test here (tests/console/test_qualification.py runs it): each profile's passed run and
promote decision are written to the database before its switch, which is then real.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from tests.console.conftest import ADMIN_TOKEN
from tests.route.conftest import ADMIN, console_settings
from tests.support import sign_in, start_console, terminate, wait_until

pytestmark = pytest.mark.slow

ALIAS = "flash-agents"
A, B = "route-a", "route-b"
LIMIT_A, LIMIT_B = 16, 1000
RETRY_AFTER = "2"
CHAT = [{"role": "user", "content": "Say hello to the route."}]


@dataclass
class Console:
    url: str
    engine_url: str
    data_dir: Path
    http: httpx.Client
    key: str
    settings: dict[str, str]
    log: Path
    proc: subprocess.Popen | None = None
    first_switch: dict | None = None

    def start(self) -> None:
        self.proc = start_console(self.settings, self.log)

    def stop(self) -> None:
        """SIGTERM, as a host's shutdown or `docker compose stop` sends it."""
        terminate(self.proc, 60)

    def get(self, path: str, **params) -> dict | list:
        response = self.http.get(path, params=params, headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, path: str, done: Callable[[dict], bool], timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while not done(body := self.get(path)):
            assert time.monotonic() < deadline, f"{path} not done within {timeout} s: {json.dumps(body)[:2000]}"
            time.sleep(0.2)
        return body

    def agent(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.key, max_retries=0, timeout=60)

    def engine(self) -> openai.OpenAI:
        """The engine's own API, which agents never reach (loopback only): the oracle for the route's answers."""
        return openai.OpenAI(base_url=f"{self.engine_url}/v1", api_key="unused", max_retries=0, timeout=60)

    def switch(self, profile: str) -> int:
        response = self.http.put(
            "/api/route/production", json={"profile": profile, "reason": "route tests"}, headers=ADMIN
        )
        assert response.status_code == 202, response.text
        return response.json()["id"]

    def switched(self, promotion_id: int) -> dict:
        return self.wait(f"/api/route/promotions/{promotion_id}", lambda p: p["status"] != "running", 90)

    def engine_pid(self) -> int:
        engine = self.get("/api/engine")
        assert engine["state"] == "ready", engine
        return engine["run"]["pid"]


def approve(data_dir: Path, profile: str) -> None:
    """A passed run and a promote decision on the profile's current content, as an operator's would be."""
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        profile_id, content_hash = conn.execute(
            "SELECT id, content_hash FROM profile WHERE name = ?", (profile,)
        ).fetchone()
        run_id = conn.execute(
            "INSERT INTO qualification_run (profile_id, content_hash, ladder, scale, status, progress, started_at,"
            " started_by, finished_at) VALUES (?, ?, 'ladder/1', 'demo', 'passed', '{}', datetime('now'), 'test',"
            " datetime('now'))",
            (profile_id, content_hash),
        ).lastrowid
        conn.execute(
            "INSERT INTO decision (profile_id, run_id, decision, reason, operator, content_hash, created_at)"
            " VALUES (?, ?, 'promote', 'route tests', 'admin', ?, datetime('now'))",
            (profile_id, run_id, content_hash),
        )


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[Console]:
    base = tmp_path_factory.mktemp("route-console")
    settings = console_settings(
        base,
        FLASHGATE_BUILD="route-test",
        FLASHGATE_ROUTE_ALIAS=ALIAS,
        FLASHGATE_ROUTE_RETRY_AFTER_S=RETRY_AFTER,
        FLASHGATE_ENGINE_GRACE_S="3",
        FLASHGATE_DRAIN_TIMEOUT_S="5",
        # The canary, not /health, finds the hang: /health gets far longer than the canary.
        FLASHGATE_ENGINE_HEALTH_TIMEOUT_S="120",
        FLASHGATE_WATCH_INTERVAL_S="0.5",
        FLASHGATE_WATCH_CANARY_TIMEOUT_S="3",
        FLASHGATE_WATCH_RESTARTS="1",
    )
    data_dir, port, engine_port = (base / "data", settings["FLASHGATE_PORT"],
                                   settings["FLASHGATE_ENGINE_PORT"])  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=60)
    console = Console(url, f"http://127.0.0.1:{engine_port}", data_dir, http, "", settings, base / "console.log")
    try:
        console.start()
        for name, parent, change in ((A, "cpu-demo", {"context_length": 1024}), (B, A, {})):
            limit = LIMIT_A if name == A else LIMIT_B
            created = http.post(
                f"/api/profiles/{parent}/children",
                json={"name": name, "rationale": "the route's output clamp", "max_output_tokens": limit, **change},
                headers=ADMIN,
            )
            assert created.status_code == 201, created.text
            approve(data_dir, name)
        key = http.post("/api/keys", json={"name": "pi"}, headers=ADMIN)
        assert key.status_code == 201, key.text
        console.key = key.json()["key"]
        switch = console.switched(console.switch(A))
        assert switch["status"] == "committed", switch
        console.first_switch = switch
        yield console
    finally:
        if console.proc is not None:
            console.stop()
        http.close()


def test_agents_get_the_engines_own_answers_under_the_alias(console: Console):
    agent, engine = console.agent(), console.engine()
    models = agent.models.list().data
    assert [m.id for m in models] == [ALIAS]
    assert models[0].context_length == 1024 and models[0].max_output_tokens == LIMIT_A

    ask = {"messages": CHAT, "max_tokens": 8, "temperature": 0}
    routed = agent.chat.completions.with_raw_response.create(model=ALIAS, **ask)
    assert routed.headers["x-flashgate-profile"] == A
    mine, own = routed.parse(), engine.chat.completions.create(model=A, **ask)
    assert mine.model == ALIAS and own.model == A
    assert mine.choices[0].message.content == own.choices[0].message.content
    assert mine.choices[0].finish_reason == own.choices[0].finish_reason and mine.usage == own.usage

    def streamed(client: openai.OpenAI, model: str) -> tuple[str, list[str | None], object]:
        chunks = list(
            client.chat.completions.create(model=model, stream=True, stream_options={"include_usage": True}, **ask)
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, [c.choices[0].finish_reason for c in chunks if c.choices], chunks[-1].usage

    assert streamed(agent, ALIAS) == streamed(engine, A)
    assert {c.model for c in agent.chat.completions.create(model=ALIAS, stream=True, **ask)} == {ALIAS}

    text = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
    assert (
        agent.completions.create(model=ALIAS, **text).choices[0].text
        == engine.completions.create(model=A, **text).choices[0].text
    )

    answer = {"input": "Say hello.", "max_output_tokens": 8, "temperature": 0}
    mine, own = agent.responses.create(model=ALIAS, **answer), engine.responses.create(model=A, **answer)
    assert mine.model == ALIAS and mine.output_text == own.output_text and mine.status == own.status

    def deltas(client: openai.OpenAI, model: str) -> str:
        events = list(client.responses.create(model=model, stream=True, **answer))
        assert events[-1].type in ("response.completed", "response.incomplete")
        return "".join(e.delta for e in events if e.type == "response.output_text.delta")

    assert deltas(agent, ALIAS) == deltas(engine, A)

    # The engine listens on loopback only; the switch's smoke went through the route under the alias.
    run = console.get("/api/engine")["run"]
    assert run["command"][run["command"].index("--host") + 1] == "127.0.0.1"
    smoke = next(s for s in console.first_switch["steps"] if s["step"] == "smoke")
    assert smoke["status"] == "ok" and f"'{ALIAS}' answered through the route" in smoke["detail"]


def test_keys_are_needed_and_operator_tokens_are_not_keys(console: Console):
    ask = {"model": ALIAS, "messages": CHAT, "max_tokens": 4}
    for key in (ADMIN_TOKEN, "fg-not-a-key"):
        with pytest.raises(openai.AuthenticationError):
            console.agent(key).chat.completions.create(**ask)
    anonymous = httpx.post(f"{console.url}/v1/chat/completions", json=ask)
    assert anonymous.status_code == 401 and "an agent key is required" in anonymous.json()["error"]["message"]

    made = console.http.post("/api/keys", json={"name": "ci-bot"}, headers=ADMIN).json()
    assert made["key"].startswith("fg-") and made["requests"] == 0
    assert console.agent(made["key"]).chat.completions.create(**ask).model == ALIAS
    assert console.http.delete("/api/keys/ci-bot", headers=ADMIN).status_code == 204
    with pytest.raises(openai.AuthenticationError) as revoked:
        console.agent(made["key"]).chat.completions.create(**ask)
    assert "unknown or revoked agent key" in revoked.value.message
    # An agent key is no operator token.
    assert console.http.get("/api/profiles", headers={"Authorization": f"Bearer {console.key}"}).status_code == 401
    keys = {k["name"]: k for k in console.get("/api/keys")}
    assert keys["ci-bot"]["revoked_at"] and keys["ci-bot"]["requests"] == 1
    assert keys["pi"]["requests"] >= 7 and keys["pi"]["last_used_at"] and "key" not in keys["pi"]


def test_budgets_are_clamped_to_the_profile_and_said_so(console: Console):
    agent = console.agent()
    over = agent.chat.completions.with_raw_response.create(model=ALIAS, messages=CHAT, max_tokens=500, temperature=0)
    assert f'299 - "max_tokens clamped from 500 to {LIMIT_A} by the route"' in over.headers["warning"]
    assert over.parse().usage.completion_tokens <= LIMIT_A
    unset = agent.responses.with_raw_response.create(model=ALIAS, input="Hi")
    assert f"max_output_tokens not given: set to {LIMIT_A} by the route" in unset.headers["warning"]
    within = agent.completions.with_raw_response.create(model=ALIAS, prompt="Hi", max_tokens=4)
    assert "warning" not in within.headers
    with pytest.raises(openai.BadRequestError) as bad:
        agent.chat.completions.create(model=ALIAS, messages=CHAT, max_completion_tokens=0)
    assert bad.value.body["param"] == "max_completion_tokens" and f"from 1 to {LIMIT_A}" in bad.value.message
    with pytest.raises(openai.NotFoundError) as other:
        agent.chat.completions.create(model=A, messages=CHAT, max_tokens=4)
    assert f"the route serves '{ALIAS}'" in other.value.message


def test_client_configuration_comes_from_production(console: Console):
    pi = console.get("/api/route/client-config", client="pi")
    provider = pi["config"]["providers"]["flashgate"]
    assert provider["baseUrl"] == f"{console.url}/v1" and provider["api"] == "openai-completions"
    model = provider["models"][0]
    assert model["id"] == ALIAS and model["contextWindow"] == 1024 and model["maxTokens"] == LIMIT_A
    assert model["reasoning"] is True and model["compat"]["supportsDeveloperRole"] is True
    assert model["compat"]["reasoningEffortMap"] == {
        "minimal": "low",
        "low": "low",
        "medium": "high",
        "high": "high",
        "xhigh": "max",
    }
    assert json.loads(pi["content"]) == pi["config"] and pi["target"] == "~/.pi/agent/models.json"
    snippet = console.get("/api/route/client-config", client="openai")["content"]
    assert f'base_url="{console.url}/v1"' in snippet and f'model="{ALIAS}"' in snippet
    assert console.http.get("/api/route/client-config", params={"client": "curl"}, headers=ADMIN).status_code == 400


def test_a_switch_answers_503_with_retry_after_then_the_new_profile(console: Console):
    ask = {"model": ALIAS, "messages": CHAT, "max_tokens": 4}
    headers = {"Authorization": f"Bearer {console.key}"}
    promotion = console.switch(B)
    answers, deadline = [], time.monotonic() + 30
    while not answers or answers[-1].status_code != 200:
        assert time.monotonic() < deadline, [(a.status_code, a.text[:300]) for a in answers[-2:]]
        answers.append(console.http.post("/v1/chat/completions", json=ask, headers=headers))
        time.sleep(0.05)
    *waiting, served = answers
    assert waiting and {a.status_code for a in waiting} == {503}, [(a.status_code, a.text) for a in waiting]
    assert all(a.headers["retry-after"] == RETRY_AFTER for a in waiting)
    assert any("paused while the promote to 'route-b'" in a.json()["error"]["message"] for a in waiting)
    assert served.headers["x-flashgate-profile"] == B and served.json()["model"] == ALIAS
    assert console.switched(promotion)["status"] == "committed"
    route = console.get("/api/route")
    assert route["production"] == B and route["rollback"]["profile"] == A
    assert console.agent().models.list().data[0].max_output_tokens == LIMIT_B


def test_an_engine_killed_mid_stream_errors_the_stream_and_is_restarted(console: Console):
    killed = console.get("/api/engine")["run"]
    stream = console.agent().chat.completions.create(
        model=ALIAS, messages=CHAT, max_tokens=LIMIT_B, stream=True, extra_body={"ignore_eos": True}
    )
    received = []
    with pytest.raises(openai.APIError) as broken:
        for chunk in stream:
            received.append(chunk)
            if len(received) == 3:
                os.kill(killed["pid"], signal.SIGKILL)
    assert "the answer is incomplete" in broken.value.message and len(received) < LIMIT_B

    # The watch records its alert once the restart is done and the engine is released to the route.
    alert = console.wait("/api/route/alerts", lambda alerts: bool(alerts))[0]
    assert alert["level"] == "warning" and "crash" in alert["message"] and "restart 1 of 1" in alert["message"]
    engine = console.get("/api/engine")
    assert engine["state"] == "ready" and engine["profile"] == B and engine["run"]["started_by"] == "watch"
    answer = console.agent().chat.completions.with_raw_response.create(model=ALIAS, messages=CHAT, max_tokens=4)
    assert answer.headers["x-flashgate-profile"] == B
    actions = [r["action"] for r in console.get("/api/audit", target="route:production")]
    assert actions[:2] == ["watch.restart", "watch.crash"]


def test_repeated_failures_roll_back_with_an_alert_on_the_dashboard(console: Console):
    hung = console.engine_pid()
    os.kill(hung, signal.SIGSTOP)
    try:
        route = console.wait("/api/route", lambda r: r["production"] == A and r["transaction"] is None, 90)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the rollback killed it
            os.kill(hung, signal.SIGCONT)
    switch = route["recent"][0]
    assert switch["kind"] == "rollback" and switch["started_by"] == "watch" and switch["status"] == "committed"
    assert "2 failures within" in switch["reason"] and "hang" in switch["reason"]
    answer = console.agent().chat.completions.with_raw_response.create(model=ALIAS, messages=CHAT, max_tokens=4)
    assert answer.headers["x-flashgate-profile"] == A and answer.parse().model == ALIAS

    alert = console.get("/api/route/alerts")[0]
    assert alert["level"] == "error" and f"rolling back to '{A}'" in alert["message"]
    actions = [r["action"] for r in console.get("/api/audit", target="route:production")]
    assert actions[:3] == ["route.production", "watch.rollback", "watch.hang"]

    # The alert heads the dashboard until an operator acknowledges it.
    with httpx.Client(base_url=console.url) as browser:
        sign_in(browser, "admin", ADMIN_TOKEN)
        dashboard = browser.get("/dashboard")
        assert f'id="alert-{alert["id"]}"' in dashboard.text and f"rolling back to &#39;{A}&#39;" in dashboard.text
    acknowledged = console.http.post(f"/api/route/alerts/{alert['id']}/acknowledge", headers=ADMIN).json()
    assert acknowledged["acknowledged_by"] == "admin"
    assert alert["id"] not in [a["id"] for a in console.get("/api/route/alerts")]


def test_route_metrics_per_key_and_per_profile(console: Console):
    metrics = console.get("/api/route/metrics")
    by_key = {u["name"]: u for u in metrics["by_key"]}
    by_profile = {u["name"]: u for u in metrics["by_profile"]}
    assert metrics["alias"] == ALIAS
    assert by_key["pi"]["requests"] >= 15 and by_key["pi"]["errors"] >= 4  # the 503s, the 400 and 404, the cut stream
    assert by_key["switch smoke"]["requests"] >= 3 and by_key["production watch"]["requests"] >= 1
    assert by_key["pi"]["p95_le_s"] >= by_key["pi"]["p50_le_s"] and by_key["pi"]["max_s"] > 0
    assert set(by_profile) >= {A, B} and by_profile[B]["errors"] >= 1


def _routed(console: Console) -> httpx.Response:
    ask = {"model": ALIAS, "messages": CHAT, "max_tokens": 1}
    return console.http.post("/v1/chat/completions", json=ask, headers={"Authorization": f"Bearer {console.key}"})


def _latest_route_audit(console: Console) -> dict:
    return console.get("/api/audit", target="route:production", limit=1)[0]


def test_production_resumes_when_the_console_restarts(console: Console):
    served = console.get("/api/engine")["run"]
    console.stop()  # the engine goes with the console, as on a reboot
    console.start()
    wait_until(lambda: _routed(console).status_code == 200, "serving under the alias again", 90)
    answer = _routed(console)
    assert answer.headers["x-flashgate-profile"] == A and answer.json()["model"] == ALIAS
    engine = console.get("/api/engine")
    assert engine["run"]["id"] > served["id"] and engine["run"]["started_by"] == "watch"
    resumed = _latest_route_audit(console)
    assert (
        resumed["action"] == "watch.resume" and resumed["after"]["reason"] == "console restarted: resuming production"
    )
    closed = next(run for run in console.get("/api/engine/runs") if run["id"] == served["id"])
    assert closed["stopped_by"] == "system" and closed["keep_stopped"] is False


def test_production_an_operator_stopped_stays_stopped_across_a_restart(console: Console):
    stopped = console.http.post("/api/engine/stop", headers=ADMIN)
    assert stopped.status_code == 200 and stopped.json()["run"]["keep_stopped"] is True
    run = stopped.json()["run"]["id"]
    console.stop()
    console.start()
    wait_until(lambda: _latest_route_audit(console)["action"] == "watch.stays_stopped", "decided", 30)
    reason = _latest_route_audit(console)["after"]["reason"]
    assert reason.startswith("console restarted: production stays stopped, admin stopped it at ")
    time.sleep(1.5)  # a few watch intervals: the watch leaves it stopped too
    engine = console.get("/api/engine")
    assert engine["state"] == "stopped" and engine["run"]["id"] == run
    refused = _routed(console)
    assert refused.status_code == 503 and refused.headers["retry-after"] == RETRY_AFTER


def test_with_resume_turned_off_a_restart_leaves_production_to_the_operator(console: Console):
    started = console.http.post("/api/engine/start", json={"profile": A}, headers=ADMIN)
    assert started.status_code == 202
    wait_until(lambda: _routed(console).status_code == 200, "production serving again", 90)
    last_decision = _latest_route_audit(console)["id"]
    console.stop()
    console.settings["FLASHGATE_RESUME_PRODUCTION"] = "0"
    try:
        console.start()
        time.sleep(1.5)  # a few watch intervals
        assert console.get("/api/engine")["state"] == "stopped"
        assert _latest_route_audit(console)["id"] == last_decision  # the watch neither resumed nor decided to wait
        assert _routed(console).status_code == 503
    finally:
        del console.settings["FLASHGATE_RESUME_PRODUCTION"]
