"""Hostile requests against the real engine (issue 28), as raw HTTP: every numeric field at 0, negative, huge,
non-finite and of the wrong type; every string field empty, huge, with a lone surrogate and of the wrong type; bodies
that are not UTF-8, not JSON, not an object or nested 100k deep; tools whose parameters are not objects; stop
strings past their bounds; a 10 MB prompt; a burst. Each answer is a 4xx naming the field (or a 200 where the value
is legal), and after each the engine still answers a normal request in time; the expensive cases run a normal
request alongside and bound how long it took (tests/api/hostile.py holds the tables and the checks)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from .conftest import EngineServer
from .hostile import (
    BODIES,
    CHAT,
    COMPLETIONS,
    DEEP_BUT_LEGAL,
    HOLE,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    PROMPT_FIELD,
    RESPONSES,
    STALL_BOUND_S,
    TEMPLATES,
    USER,
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
    stop_strings,
    string_groups,
    tool_cases,
)

pytestmark = pytest.mark.slow

MODEL = "flash"
# 16 slots and 4 waiting places: the burst below fits in them exactly.
FLAGS = {"max_num_seqs": 16, "max_waiting_requests": 4, "served_model_name": MODEL}
ENDPOINTS = [pytest.param(path, id=path.removeprefix("/v1/")) for path in (CHAT, COMPLETIONS, RESPONSES)]
TEN_MB_TEXT = "hostile " * 1_310_720
PROMPT_TEMPLATES = {
    COMPLETIONS: {"prompt": HOLE, "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": HOLE}], "max_tokens": 2},
}


class Engine:
    """The module's engine. A case that ends it fails on its own, and the next case gets a new one."""

    def __init__(self, start_server) -> None:
        self.start_server = start_server
        self.server = start_server(**FLAGS)

    def serving(self) -> EngineServer:
        if not _healthy(self.server):
            self.server.stop()
            self.server = self.start_server(**FLAGS)
        return self.server


def _healthy(server: EngineServer) -> bool:
    try:
        return server.proc.poll() is None and server.http.get("/health", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def engine(start_server) -> Engine:
    return Engine(start_server)


@pytest.fixture
def server(engine: Engine) -> EngineServer:
    return engine.serving()


def normal_request(server: EngineServer) -> None:
    completion = server.client.completions.create(model=MODEL, prompt="Still serving?", max_tokens=1, temperature=0)
    assert completion.usage.completion_tokens == 1


def assert_still_serving(server: EngineServer) -> None:
    """The process lives and answers a short greedy completion, in time."""
    started = time.monotonic()
    normal_request(server)
    assert time.monotonic() - started < STALL_BOUND_S
    assert server.proc.poll() is None


def greedy_text(server: EngineServer, temperature: str, max_tokens: int = 8) -> str:
    template = {"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "temperature": HOLE}
    answer = post(server.http, COMPLETIONS, body(template, temperature))
    assert_answered(answer)
    return json.loads(answer.text)["choices"][0]["text"]


def down(server: EngineServer) -> str | None:
    """How the engine is down, or None."""
    if server.proc.poll() is not None:
        return f"the engine exited with {server.proc.returncode}"
    try:
        status = server.http.get("/health", timeout=5).status_code
    except httpx.TransportError as error:
        return f"/health failed: {error!r}"
    return None if status == 200 else f"/health answered {status}"


def assert_right_answers(server: EngineServer, endpoint: str, cases: dict[str, Case]) -> None:
    """Each case's answer is right and the engine stays up after each; then it answers a normal request."""
    found = problems(
        lambda case: post(server.http, endpoint, case.content, stream=case.stream), cases, lambda: down(server)
    )
    assert not found, report(found)
    assert_still_serving(server)


@pytest.mark.parametrize(("endpoint", "field", "cases"), numeric_groups())
def test_numeric_fields_refuse_what_is_not_legal_by_name(server, endpoint, field, cases):
    assert_right_answers(server, endpoint, cases)


@pytest.mark.parametrize(("endpoint", "field", "cases"), string_groups())
def test_string_fields_refuse_what_is_not_legal_by_name(server, endpoint, field, cases):
    assert_right_answers(server, endpoint, cases)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_bodies_that_are_no_json_object_are_refused_as_a_whole(server, endpoint):
    assert_right_answers(server, endpoint, BODIES)


def test_nesting_within_the_depth_limit_is_legal(server):
    assert_answered(post(server.http, CHAT, DEEP_BUT_LEGAL))


@pytest.mark.parametrize("endpoint", [CHAT, RESPONSES])
def test_tools_whose_parameters_are_not_objects_are_refused_by_name(server, endpoint):
    assert_right_answers(server, endpoint, tool_cases(endpoint))


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
def test_stop_strings_past_their_bounds_are_refused_naming_the_limit(server, endpoint):
    assert_right_answers(server, endpoint, stop_cases(endpoint))


def test_stop_strings_at_their_bounds_still_cut_the_text(server):
    full = greedy_text(server, "0", max_tokens=24)
    stop = full[6:9]
    # The most strings of the most characters, the last of them one the text holds.
    stops = [*stop_strings(MAX_STOP_STRINGS - 1, MAX_STOP_STRING_CHARS), stop]
    template = {"prompt": "Hello", "max_tokens": 24, "ignore_eos": True, "temperature": 0, "stop": HOLE}
    for stream in (False, True):
        with server.http.stream(
            "POST", COMPLETIONS, content=body(template | {"stream": stream}, json.dumps(stops))
        ) as response:
            assert response.status_code == 200, response.read()
            if stream:
                events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
                text = "".join(e["choices"][0]["text"] for e in events)
            else:
                text = json.loads(response.read())["choices"][0]["text"]
        assert text == full[: full.index(stop)]


@pytest.fixture(scope="module")
def greedy(engine: Engine) -> str:
    return greedy_text(engine.serving(), "0")


@pytest.mark.parametrize("temperature", ["1e-39", "1e-300", "5e-324", "1e-6", "-0.0"])
def test_tiny_temperatures_are_greedy(server, greedy, temperature):
    assert greedy_text(server, temperature) == greedy
    assert_still_serving(server)


def test_a_tiny_temperature_through_the_openai_client_is_greedy(server):
    def content(temperature: float) -> str:
        return (
            server.client.chat.completions.create(
                model=MODEL, messages=[USER], max_tokens=8, temperature=temperature, extra_body={"ignore_eos": True}
            )
            .choices[0]
            .message.content
        )

    assert content(1e-39) == content(0)


def test_hostile_sampling_in_a_running_batch_leaves_the_others_whole(server):
    """Requests whose sampling once failed inside a step, sent while a batch runs: they answer, and the batch's
    requests end as they do alone."""
    ask = {
        "model": MODEL,
        "prompt": "A long story",
        "max_tokens": 32,
        "temperature": 0,
        "extra_body": {"ignore_eos": True},
    }
    alone = server.client.completions.create(**ask).choices[0].text

    def streamed() -> str:
        return "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **ask))

    with ThreadPoolExecutor(3) as pool:
        batch = [pool.submit(streamed) for _ in range(3)]
        server.wait_metric("flashgate_requests_running", lambda running: running >= 3)
        for temperature in ("1e-39", "5e-324"):
            assert_answered(
                post(server.http, COMPLETIONS, body(TEMPLATES[COMPLETIONS] | {"temperature": HOLE}, temperature))
            )
        assert [future.result() for future in batch] == [alone] * 3
    assert_still_serving(server)


def test_a_burst_within_the_free_slots_and_waiting_places_is_admitted(server):
    """20 requests at once against 16 free slots and 4 waiting places: every request that had a slot is admitted,
    and whatever is refused is refused as a full queue."""
    barrier = threading.Barrier(20)

    def send(i: int) -> httpx.Response:
        barrier.wait()
        return httpx.post(f"{server.url}{COMPLETIONS}", json={"prompt": f"Burst {i}", "max_tokens": 4}, timeout=60)

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(send, range(20)))
    statuses = [a.status_code for a in answers]
    assert statuses.count(200) >= 16, statuses
    assert all(a.json()["error"]["code"] == "queue_full" for a in answers if a.status_code != 200), statuses
    assert_still_serving(server)


# The expensive cases: a normal request runs while each is in flight.


def test_a_thousand_long_stop_strings_are_refused_without_stalling_others(server):
    stops = json.dumps(stop_strings(1000, 10_240))  # 10 MB: once 63 s for 16 tokens, and every request with it
    hostile = body(TEMPLATES[COMPLETIONS] | {"stop": HOLE}, stops)
    overlap = alongside(lambda: post(server.http, COMPLETIONS, hostile, timeout=120), lambda: normal_request(server))
    assert_refused(overlap.hostile, "stop", None)
    assert overlap.hostile.seconds < STALL_BOUND_S and overlap.normal_s < STALL_BOUND_S, overlap
    assert_still_serving(server)


@pytest.mark.parametrize("endpoint", [COMPLETIONS, CHAT])
def test_a_ten_megabyte_prompt_is_refused_before_it_is_tokenized(server, endpoint):
    hostile = body(PROMPT_TEMPLATES[endpoint], json.dumps(TEN_MB_TEXT))
    overlap = alongside(lambda: post(server.http, endpoint, hostile, timeout=120), lambda: normal_request(server))
    error = assert_refused(overlap.hostile, PROMPT_FIELD[endpoint], None)
    assert error["code"] in ("context_length_exceeded", "request_too_large"), error
    assert overlap.hostile.seconds < STALL_BOUND_S and overlap.normal_s < STALL_BOUND_S, overlap
    assert_still_serving(server)
