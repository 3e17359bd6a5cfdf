"""The production watch tells a busy engine from a hung one: a real console process, its real engine child on the
shipped demo model, and agents' streams through the route that keep a queue far longer than the canary's timeout. A
hang is an engine with work that runs no step; a long queue is not one, and production is left serving."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.route.conftest import ADMIN, console_settings
from tests.route.test_route import approve
from tests.support import start_console, terminate, wait_until

pytestmark = pytest.mark.slow

ALIAS = "flash-busy"
BUSY = "busy-one-seq"
CANARY_TIMEOUT_S = 1.5
STREAMS = 4
STREAM_TOKENS = 250


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[tuple[httpx.Client, str, str]]:
    base = tmp_path_factory.mktemp("watch-console")
    settings = console_settings(
        base,
        FLASHGATE_ROUTE_ALIAS=ALIAS,
        FLASHGATE_ENGINE_GRACE_S="3",
        FLASHGATE_ENGINE_HEALTH_TIMEOUT_S="120",
        FLASHGATE_WATCH_INTERVAL_S="0.5",
        FLASHGATE_WATCH_CANARY_TIMEOUT_S=str(CANARY_TIMEOUT_S),
    )
    data_dir, port = base / "data", settings["FLASHGATE_PORT"]
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60, headers=ADMIN)
    proc = start_console(settings, base / "console.log")
    try:
        # One running sequence: every other request waits in the engine's queue, as 95 streams on a max_num_seqs 4
        # production did.
        created = http.post(
            "/api/profiles/cpu-demo/children",
            json={
                "name": BUSY,
                "rationale": "one running sequence, so agents queue",
                "context_length": 1024,
                "max_num_seqs": 1,
                "max_output_tokens": STREAM_TOKENS,
            },
        )
        assert created.status_code == 201, created.text
        approve(data_dir, BUSY)
        key = http.post("/api/keys", json={"name": "agents"})
        assert key.status_code == 201, key.text
        switch = http.put("/api/route/production", json={"profile": BUSY, "reason": "watch tests"})
        assert switch.status_code == 202, switch.text
        promotion = f"/api/route/promotions/{switch.json()['id']}"
        wait_until(lambda: http.get(promotion).json()["status"] != "running", "switched", 90)
        assert http.get(promotion).json()["status"] == "committed", http.get(promotion).text
        yield http, f"http://127.0.0.1:{port}/v1", key.json()["key"]
    finally:
        terminate(proc, 60)
        http.close()


def _watch_actions(http: httpx.Client) -> list[str]:
    return [row["action"] for row in http.get("/api/audit", params={"target": "route:production"}).json()]


def test_a_long_queue_is_busy_not_hung(console):
    http, url, key = console
    served = http.get("/api/engine").json()["run"]
    agent = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=120)
    finished: list[int] = []
    failed: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = agent.chat.completions.create(
                model=ALIAS,
                messages=[{"role": "user", "content": "Tell a long story."}],
                max_tokens=STREAM_TOKENS,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            finished.append(sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None))
        except openai.APIError as exc:
            failed.append(exc)

    streams = [threading.Thread(target=stream) for _ in range(STREAMS)]
    started = time.monotonic()
    for thread in streams:
        thread.start()
    for thread in streams:
        thread.join(timeout=300)
    took = time.monotonic() - started
    # The last stream waited behind the others for longer than the canary may take: the old watch's canary, queued
    # behind them, timed out and restarted production, cutting the streams.
    assert took > 3 * CANARY_TIMEOUT_S, f"the queue lasted only {took:.1f} s: the test shows nothing"
    assert not failed and len(finished) == STREAMS, failed
    assert "watch.hang" not in _watch_actions(http) and "watch.restart" not in _watch_actions(http)
    engine = http.get("/api/engine").json()
    assert engine["state"] == "ready" and engine["run"]["id"] == served["id"]


def test_an_engine_that_answers_nothing_is_hung_and_restarted(console):
    http, url, key = console
    hung = http.get("/api/engine").json()["run"]
    os.kill(hung["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: "watch.restart" in _watch_actions(http), "restarted by the watch", 90)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the restart killed it
            os.kill(hung["pid"], signal.SIGCONT)
    hang = next(
        r for r in http.get("/api/audit", params={"target": "route:production"}).json() if r["action"] == "watch.hang"
    )
    assert hang["after"]["engine_run"] == hung["id"]
    wait_until(lambda: http.get("/api/engine").json()["state"] == "ready", "serving again", 90)
    assert http.get("/api/engine").json()["run"]["started_by"] == "watch"
