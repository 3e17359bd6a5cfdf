"""Hostile requests through the console's `/v1` route with an agent key (issue 28): a real console process on a real
SQLite file, its real engine child on the shipped demo model as production. The kinds of tests/api/test_hostile.py
(its tables, tests/api/hostile.py), in the values the route itself reads or writes again: numbers JSON allows only to
Python (NaN, Infinity), huge integers, the wrong types, the budget fields it clamps; lone surrogates, huge strings;
bodies that are not UTF-8, not JSON or nested 100k deep; tools whose parameters are not objects; stop strings past
their bounds; a 10 MB prompt and a 62 MB body while a normal request runs alongside. After each, production still
answers a normal request in time, from the same engine process (no crash for the watch to restart)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import openai
import pytest

from app.engine_control.slot import IN_FLIGHT
from app.telemetry import prometheus
from tests.api.hostile import (
    BODIES,
    CHAT,
    COMPLETIONS,
    HOLE,
    PROMPT_FIELD,
    RESPONSES,
    STALL_BOUND_S,
    TEMPLATES,
    Answer,
    Case,
    alongside,
    assert_answered,
    assert_refused,
    body,
    numeric_groups,
    post,
    problems,
    report,
    stop_cases,
    string_groups,
    tool_cases,
)
from tests.route.conftest import ADMIN, console_settings
from tests.route.test_route import Console, approve
from tests.support import wait_until

pytestmark = pytest.mark.slow

ALIAS = "flash-hostile"
PROFILE = "route-hostile"
LIMIT = 16
# The values the route parses and writes again: non-finite numbers, huge integers and floats, the wrong type.
ROUTE_NUMBERS = ("NaN", "Infinity", "2**64", "string")
ROUTE_STRINGS = ("huge", "surrogate", "number")


@pytest.fixture(scope="module")
def console(tmp_path_factory) -> Iterator[Console]:
    """A console whose production is one small profile (1024 tokens of context, 16 output tokens), and a key."""
    base = tmp_path_factory.mktemp("hostile-route")
    settings = console_settings(
        base,
        FLASHGATE_BUILD="route-test",
        FLASHGATE_ROUTE_ALIAS=ALIAS,
        FLASHGATE_ROUTE_RETRY_AFTER_S="1",
        # A case that ends the engine fails on its own: the watch restarts production at once for the next, however
        # many cases did; and it never calls a busy engine hung.
        FLASHGATE_WATCH_INTERVAL_S="0.5",
        FLASHGATE_WATCH_RESTARTS="1000",
        FLASHGATE_WATCH_CANARY_TIMEOUT_S="120",
    )
    data_dir, port = base / "data", settings["FLASHGATE_PORT"]
    url = f"http://127.0.0.1:{port}"
    http = httpx.Client(base_url=url, timeout=60)
    console = Console(url, "", data_dir, http, "", settings, base / "console.log")
    try:
        console.start()
        created = http.post(
            "/api/profiles/cpu-demo/children",
            json={"name": PROFILE, "rationale": "hostile requests", "max_output_tokens": LIMIT, "context_length": 1024},
            headers=ADMIN,
        )
        assert created.status_code == 201, created.text
        approve(data_dir, PROFILE)
        key = http.post("/api/keys", json={"name": "hostile"}, headers=ADMIN)
        assert key.status_code == 201, key.text
        console.key = key.json()["key"]
        assert console.switched(console.switch(PROFILE))["status"] == "committed"
        console.engine_url = f"http://127.0.0.1:{settings['FLASHGATE_ENGINE_PORT']}"
        yield console
    finally:
        if console.proc is not None:
            console.stop()
        http.close()


@pytest.fixture(scope="module")
def agent(console: Console) -> Iterator[httpx.Client]:
    """Raw HTTP to the route with the agent key."""
    with httpx.Client(base_url=console.url, headers={"Authorization": f"Bearer {console.key}"}, timeout=60) as http:
        yield http


def normal_request(console: Console) -> None:
    completion = console.agent().completions.create(model=ALIAS, prompt="Still serving?", max_tokens=1, temperature=0)
    assert completion.usage.completion_tokens == 1


def serves(console: Console) -> bool:
    try:
        normal_request(console)
    except openai.APIError:
        return False
    return console.get("/api/engine")["state"] == "ready"


@pytest.fixture
def pid(console: Console) -> int:
    """Production's engine process as the case starts: a case that ended the engine fails on its own, and the next
    waits for the watch's restart."""
    wait_until(lambda: serves(console), "production serving", 120)
    return console.engine_pid()


def down(console: Console, pid: int) -> str | None:
    """How production's engine is down or was replaced since the case started, or None."""
    try:
        status = httpx.get(f"{console.engine_url}/health", timeout=5).status_code
    except httpx.TransportError as error:
        return f"the engine's /health failed: {error!r}"
    if status != 200:
        return f"the engine's /health answered {status}"
    engine = console.get("/api/engine")
    if engine["state"] != "ready" or engine["run"]["pid"] != pid:
        return f"the engine is {engine['state']}, pid {engine['run']['pid']} (was {pid})"
    return None


def assert_still_serving(console: Console, pid: int) -> None:
    """Production answers a short greedy completion in time, from the same engine process."""
    started = time.monotonic()
    normal_request(console)
    assert time.monotonic() - started < STALL_BOUND_S
    assert console.engine_pid() == pid, "production's engine was restarted"


def assert_right_answers(console: Console, agent: httpx.Client, pid: int, endpoint: str, cases: dict[str, Case]):
    found = problems(
        lambda case: post(agent, endpoint, case.content, stream=case.stream), cases, lambda: down(console, pid)
    )
    assert not found, report(found)
    assert_still_serving(console, pid)


@pytest.mark.parametrize(("endpoint", "field", "cases"), numeric_groups(ROUTE_NUMBERS))
def test_numeric_fields_through_the_route(console, agent, pid, endpoint, field, cases):
    assert_right_answers(console, agent, pid, endpoint, cases)


@pytest.mark.parametrize(("endpoint", "field", "cases"), string_groups(ROUTE_STRINGS))
def test_string_fields_through_the_route(console, agent, pid, endpoint, field, cases):
    assert_right_answers(console, agent, pid, endpoint, cases)


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_bodies_that_are_no_json_object_through_the_route(console, agent, pid, endpoint):
    assert_right_answers(console, agent, pid, endpoint, BODIES)


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_tools_whose_parameters_are_not_objects_through_the_route(console, agent, pid, endpoint):
    assert_right_answers(console, agent, pid, endpoint, tool_cases(endpoint))


def test_stop_strings_past_their_bounds_through_the_route(console, agent, pid):
    assert_right_answers(console, agent, pid, CHAT, stop_cases(CHAT))


def test_temperatures_that_once_ended_the_engine_do_not_through_the_route(console, agent, pid):
    """1e-39 is greedy; NaN is refused naming temperature; neither ends production's engine."""
    template = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True, "temperature": HOLE}

    def text(temperature: str) -> str:
        answer = post(agent, COMPLETIONS, body(template, temperature))
        assert_answered(answer)
        return json.loads(answer.text)["choices"][0]["text"]

    assert text("1e-39") == text("5e-324") == text("0")
    assert_refused(post(agent, COMPLETIONS, body(template, "NaN")), "temperature")
    assert down(console, pid) is None
    assert_still_serving(console, pid)
    assert not console.get("/api/route/alerts"), "the watch saw production fail"


def test_a_huge_budget_is_clamped_to_the_profiles_limit(console, agent, pid):
    answer = post(agent, CHAT, body(TEMPLATES[CHAT] | {"max_tokens": HOLE, "temperature": 0}, str(2**64)))
    assert_answered(answer)
    assert json.loads(answer.text)["usage"]["completion_tokens"] <= LIMIT
    assert f"clamped from {2**64} to {LIMIT} by the route" in answer.headers["warning"]


# The expensive cases: a normal request runs through the route while each is in flight.


@pytest.mark.parametrize(
    ("endpoint", "megabytes", "chunked"),
    [
        pytest.param(COMPLETIONS, 10, False, id="10MB-prompt"),
        pytest.param(CHAT, 62, False, id="62MB-content"),
        # No Content-Length: the route learns the size as the body streams in.
        pytest.param(CHAT, 62, True, id="62MB-content-chunked"),
    ],
)
def test_a_body_too_large_for_the_context_is_refused_without_stalling_others(
    console, agent, pid, endpoint, megabytes, chunked
):
    template = {"prompt": HOLE} if endpoint == COMPLETIONS else {"messages": [{"role": "user", "content": HOLE}]}
    hostile = body(template | {"max_tokens": 2}, json.dumps("hostile " * (megabytes << 17)))

    def send() -> Answer:
        content = (hostile[i : i + (1 << 20)] for i in range(0, len(hostile), 1 << 20)) if chunked else hostile
        return post(agent, endpoint, content, timeout=120)

    overlap = alongside(send, lambda: normal_request(console))
    error = assert_refused(overlap.hostile, PROMPT_FIELD[endpoint], None)
    assert error["code"] in ("context_length_exceeded", "request_too_large"), error
    assert overlap.hostile.seconds < STALL_BOUND_S and overlap.normal_s < STALL_BOUND_S, overlap
    assert_still_serving(console, pid)


def test_the_route_holds_no_more_agent_requests_than_production_admits(console, agent):
    """The route's own bound, from production's admission limits: with max_num_seqs 1 and max_waiting_requests 1
    it holds two agent requests (one running, one waiting); a third is the route's 429 with Retry-After, not a
    connection pool's timeout. A held request that its client drops no longer counts. Last in the module: it
    switches production to a narrow child."""
    narrow = "route-narrow"
    created = console.http.post(
        f"/api/profiles/{PROFILE}/children",
        json={"name": narrow, "rationale": "one running, one waiting", "max_num_seqs": 1, "cuda_graph_max_bs": 1,
              "max_output_tokens": 900, "engine_extras": {"max_waiting_requests": 1}},
        headers=ADMIN,
    )  # fmt: skip
    assert created.status_code == 201, created.text
    approve(console.data_dir, narrow)
    assert console.switched(console.switch(narrow))["status"] == "committed"
    long = {"model": ALIAS, "prompt": "Hold on", "max_tokens": 900, "ignore_eos": True, "stream": True}
    engine = httpx.Client(base_url=console.engine_url, timeout=10)

    def in_flight() -> int:
        samples = prometheus.parse(engine.get("/metrics").text)
        return sum(int(prometheus.total(samples, name) or 0) for name in IN_FLIGHT)

    for _ in range(10):
        # The production watch sends its canary (every 0.5 s here) only to an idle engine, and a dropped request
        # leaves the engine a moment after its client: start from an idle engine, and send the second only once the
        # engine holds the first alone (a canary that came in with the first has answered its 16 tokens).
        wait_until(lambda: in_flight() == 0, "the engine idle", 60)
        with ExitStack() as held:
            first = held.enter_context(agent.stream("POST", COMPLETIONS, json=long))
            assert first.status_code == 200, first.read()
            wait_until(lambda: in_flight() == 1, "the engine holding the first request alone", 60)
            second = held.enter_context(agent.stream("POST", COMPLETIONS, json=long))
            if second.status_code == 429 and b"queue_full" in second.read():
                continue  # a canary came in between the count and the second request: let both leave, retry
            assert second.status_code == 200, second.read()
            third = agent.post(COMPLETIONS, json=long | {"stream": False})
            assert third.status_code == 429, third.text
            error = third.json()["error"]
            assert error["code"] == "route_full" and "max_num_seqs + max_waiting_requests = 2" in error["message"]
            assert third.headers["retry-after"] == "1"
            break
    else:
        pytest.fail("a canary came in with the second held request ten times")
    # Both clients went away: their requests leave the route's count (and the engine), so it admits again.
    short = long | {"stream": False, "max_tokens": 1}
    wait_until(lambda: agent.post(COMPLETIONS, json=short).status_code == 200, "the route admits again", 30)
