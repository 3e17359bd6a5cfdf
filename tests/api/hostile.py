"""Hostile requests (issue 28), shared by the engine's suite (tests/api/test_hostile.py) and the route's
(tests/route/test_hostile_route.py): the cases as tables of raw JSON text put into request templates, and what every
answer to one must be: a 4xx in the OpenAI error shape naming the field (or a 200 where the value is legal), never a
500, never Python's own exception text."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from enum import Enum
from typing import Any

import httpx
import pytest

from engine.server.protocol import MAX_JSON_DEPTH, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

# A normal request takes ~0.1 s on the tiny CPU model; 3 s leaves room for two cores shared with other test runs
# and is still far below the stalls the issue measured (14.7 s behind a 10 MB prompt, 24 s behind stop strings).
STALL_BOUND_S = 3.0
# How long after a hostile request is sent the concurrent normal one starts: its body is sent and being handled.
IN_FLIGHT_S = 0.3

PYTHON_TEXT = ("Traceback", "Error(", "Overflow")
BODY_CODES = {"invalid_json", "invalid_request_body", "request_too_large"}
# Where a case's raw JSON text goes in a request template.
HOLE = "<hostile>"

CHAT, COMPLETIONS, RESPONSES = "/v1/chat/completions", "/v1/completions", "/v1/responses"
TEMPLATES = {
    COMPLETIONS: {"prompt": "Hello", "max_tokens": 2},
    CHAT: {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2},
    RESPONSES: {"input": "Hello", "max_output_tokens": 2},
}
# The field a refusal for a prompt too long for the context names, per endpoint.
PROMPT_FIELD = {COMPLETIONS: "prompt", CHAT: "messages", RESPONSES: "input"}
BUDGET_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
SHORT = {CHAT: "chat", COMPLETIONS: "completions", RESPONSES: "responses"}


class Legal(Enum):
    """What a legal value's answer is; a value not marked legal must be refused."""

    OK = "200"
    CLAMPED = "200, the budget clamped with a Warning"
    EITHER = "200, or a 4xx naming the field"


OK, CLAMPED, EITHER = Legal.OK, Legal.CLAMPED, Legal.EITHER


def body(template: dict[str, Any], raw: str) -> bytes:
    """The template as JSON with `raw` (JSON text: NaN, a lone surrogate's escape, …) in place of its HOLE."""
    text = json.dumps(template)
    assert text.count(json.dumps(HOLE)) == 1
    return text.replace(json.dumps(HOLE), raw).encode()


def with_field(endpoint: str, field: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The endpoint's template with `field` as the HOLE (a budget field replaces the template's own budget)."""
    template = dict(TEMPLATES[endpoint])
    if field in BUDGET_FIELDS:
        template = {k: v for k, v in template.items() if k not in BUDGET_FIELDS}
    return template | (extra or {}) | {field: HOLE}


# Numbers: every numeric field at 0, negative, huge, non-finite (JSON to Python's parser) and of the wrong type.
NUMBERS = {
    "0": "0",
    "negative": "-1",
    "1e308": "1e308",
    "10**30": str(10**30),
    "2**64": str(2**64),
    "NaN": "NaN",
    "Infinity": "Infinity",
    "-Infinity": "-Infinity",
    "string": '"1"',
    "bool": "true",
    "list": "[1]",
    "object": "{}",
}
TEMPERATURE = {"0": OK, "1e308": OK, "10**30": OK, "2**64": OK, "1e999": None, "-0.0": OK, "1e-39": OK}
TOP_P = {"1": OK, "1e-39": OK, "1.0000001": None}
BUDGET = {"10**30": CLAMPED, "2**64": CLAMPED, "2.5": None}
SEED = {"0": OK, "negative": OK, str(-(2**63)): OK, str(-(2**63) - 1): None, str(2**64 - 1): OK}
# (endpoint, field, what the template adds, the legal values of NUMBERS and further values as raw JSON): a value
# not marked legal must be refused.
NUMERIC_FIELDS = [
    (COMPLETIONS, "temperature", {}, TEMPERATURE),
    (COMPLETIONS, "top_p", {}, TOP_P),
    # -1 and 0 are "off"; a top_k past the vocabulary is off in effect, or may be refused.
    (COMPLETIONS, "top_k", {}, {"0": OK, "negative": OK, "10**30": EITHER, "2**64": EITHER, "-2": None, "1.5": None}),
    (COMPLETIONS, "max_tokens", {}, BUDGET),
    (COMPLETIONS, "seed", {}, SEED),  # [-2**63, 2**64)
    (COMPLETIONS, "logprobs", {}, {"0": OK, "20": OK, "21": None}),
    (COMPLETIONS, "n", {}, {}),
    (COMPLETIONS, "best_of", {}, {}),
    (CHAT, "max_tokens", {}, BUDGET),
    (CHAT, "max_completion_tokens", {}, BUDGET),
    # Chat's logprobs is a boolean; an integer 0 may pass as false.
    (CHAT, "logprobs", {}, {"bool": OK, "0": EITHER}),
    (CHAT, "top_logprobs", {"logprobs": True}, {"0": OK, "21": None}),
    (CHAT, "n", {}, {}),
    (RESPONSES, "max_output_tokens", {}, BUDGET),
    (RESPONSES, "temperature", {}, TEMPERATURE),
    (RESPONSES, "top_p", {}, TOP_P),
]


@dataclass(frozen=True)
class Case:
    """One hostile value of a field: the request's body, and the answer it must get."""

    content: bytes
    legal: Legal | None  # None: refused
    fields: tuple[str | None, ...]  # what a refusal may name (None: the whole body)
    limit: str | None = None  # what a refusal's message must name

    @property
    def stream(self) -> bool:
        # A clamped budget runs to the end of the context: its stream is read up to its first event, then dropped.
        return self.legal is CLAMPED


def numeric_groups(labels: Collection[str] | None = None) -> list:
    """pytest params (endpoint, field, cases by value) of NUMERIC_FIELDS, each field with the values of NUMBERS (or
    those of `labels`) and its own further values."""
    groups = []
    for endpoint, field, extra, legal in NUMERIC_FIELDS:
        template = with_field(endpoint, field, extra)
        values = {label: raw for label, raw in NUMBERS.items() if labels is None or label in labels}
        values |= {raw: raw for raw in legal if raw not in NUMBERS}
        cases = {
            label: Case(body(template | ({"stream": True} if legal.get(label) is CLAMPED else {}), raw),
                        legal.get(label), (field,))
            for label, raw in values.items()
        }  # fmt: skip
        groups.append(pytest.param(endpoint, field, cases, id=f"{SHORT[endpoint]}-{field}"))
    return groups


# Strings: every string field empty, huge, holding a lone surrogate, and of the wrong type.
HUGE_TEXT = "hostile " * 8192  # 64 KB: thousands of tokens, far past the 1024-token context
STRINGS = {
    "empty": '""',
    "huge": json.dumps(HUGE_TEXT),
    "surrogate": '"Hello \\ud800 there"',  # a lone surrogate: valid JSON, and no UTF-8 can carry it
    "number": "1",
    "object": "{}",
}


def tool(name: Any = "read_file", description: Any = "Read a file", parameters: Any = None) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"path": {"type": "string"}}} if parameters is None else parameters
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


def flat_tool(name: Any = "read_file", parameters: Any = None) -> dict[str, Any]:
    """A Responses tool: the function's fields at the top."""
    return {"type": "function", **tool(name, parameters=parameters)["function"]}


USER = {"role": "user", "content": "Hello"}
# (endpoint, the field's path, its template, the legal values of STRINGS); every other value is refused.
STRING_FIELDS = [
    (COMPLETIONS, "prompt", with_field(COMPLETIONS, "prompt"), {}),
    (CHAT, "messages[0].content", {"messages": [{"role": "user", "content": HOLE}], "max_tokens": 2}, {"empty": OK}),
    (CHAT, "messages[0].role", {"messages": [{"role": HOLE, "content": "Hello"}], "max_tokens": 2}, {}),
    (CHAT, "tools[0].function.name", {"messages": [USER], "tools": [tool(name=HOLE)], "max_tokens": 2}, {}),
    (
        CHAT,
        "tools[0].function.description",
        {"messages": [USER], "tools": [tool(description=HOLE)], "max_tokens": 2},
        {"empty": OK},
    ),
    (CHAT, "stop", with_field(CHAT, "stop"), {}),
    (CHAT, "model", with_field(CHAT, "model"), {}),
    (RESPONSES, "input", with_field(RESPONSES, "input"), {"empty": EITHER}),
    (RESPONSES, "instructions", with_field(RESPONSES, "instructions"), {"empty": OK}),
    (RESPONSES, "tools[0].name", {"input": "Hello", "tools": [flat_tool(name=HOLE)], "max_output_tokens": 2}, {}),
]


def string_groups(labels: Collection[str] | None = None) -> list:
    """pytest params (endpoint, field, cases by value) of STRING_FIELDS with the values of STRINGS (or those of
    `labels`)."""
    groups = []
    for endpoint, field, template, legal in STRING_FIELDS:
        cases = {}
        for label, raw in STRINGS.items():
            if labels is not None and label not in labels:
                continue
            # A huge value may be refused as the field's, as a prompt too long for the context, or as a body too large.
            fields = (field, PROMPT_FIELD[endpoint], None) if label == "huge" else (field,)
            cases[label] = Case(body(template, raw), legal.get(label), fields)
        groups.append(pytest.param(endpoint, field, cases, id=field))
    return groups


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def refused(content: bytes, *fields: str | None, limit: str | None = None) -> Case:
    return Case(content, None, fields, limit)


# Whole bodies: not UTF-8, not JSON, not an object, too deep; refused as a whole (too deep: naming the limit).
DEPTH = str(MAX_JSON_DEPTH)
BODIES = {
    "not-utf8": refused(b'{"prompt": "\xff\xfe", "messages": "\xc3\x28", "input": "\xed\xa0\x80"}', None),
    "not-utf8-before-the-object": refused(b"\xff" + json.dumps(TEMPLATES[CHAT]).encode(), None),
    "not-json": refused(b"{not json", None),
    "empty": refused(b"", None),
    "trailing-data": refused(b'{"prompt": "Hello"} trailing', None),
    "an-array": refused(b"[1, 2]", None),
    "a-string": refused(b'"Hello"', None),
    "null": refused(b"null", None),
    "array-nested-100k-deep": refused(nested(100_000).encode(), None, limit=DEPTH),
    "object-nested-100k-deep": refused(('{"a": ' * 100_000 + "1" + "}" * 100_000).encode(), None, limit=DEPTH),
    "a-field-past-the-depth-limit": refused(
        body(TEMPLATES[CHAT] | {"metadata": HOLE}, nested(MAX_JSON_DEPTH + 1)), None, limit=DEPTH
    ),
}
# Within the depth limit, an unknown field is ignored.
DEEP_BUT_LEGAL = body(TEMPLATES[CHAT] | {"metadata": HOLE}, nested(MAX_JSON_DEPTH // 2))

# Tools whose parameters (or their properties) are not objects, for chat and for Responses.
BAD_PARAMETERS = {
    "properties-an-array": {"type": "object", "properties": []},
    "properties-a-string": {"type": "object", "properties": "x"},
    "properties-a-number": {"type": "object", "properties": 1},
    "parameters-an-array": [],
    "parameters-a-string": "x",
    "parameters-a-number": 1,
    "a-property-schema-a-number": {"type": "object", "properties": {"path": 1}},
}


def tool_cases(endpoint: str) -> dict[str, Case]:
    """Tools that are not what a tool is, each refused naming tools[0]."""
    make = tool if endpoint == CHAT else flat_tool
    tools = {what: [make(parameters=parameters)] for what, parameters in BAD_PARAMETERS.items()}
    if endpoint == CHAT:
        tools |= {"a-string": ["read_file"], "function-a-string": [{"type": "function", "function": "read_file"}]}
    template = TEMPLATES[endpoint] | {"tools": HOLE}
    return {what: refused(body(template, json.dumps(given)), "tools[0]") for what, given in tools.items()}


def stop_strings(count: int, chars: int) -> list[str]:
    """`count` distinct stop strings of `chars` characters that the tiny model will not write."""
    return [(f"§{i}§" * chars)[:chars] for i in range(count)]


def stop_cases(endpoint: str) -> dict[str, Case]:
    """Stop strings past their bounds, refused naming `stop` and the bound."""
    template = TEMPLATES[endpoint] | {"stop": HOLE}
    return {
        "too-many": refused(body(template, json.dumps(stop_strings(MAX_STOP_STRINGS + 1, 4))), "stop",
                            limit=str(MAX_STOP_STRINGS)),
        "too-long": refused(body(template, json.dumps(stop_strings(1, MAX_STOP_STRING_CHARS + 1))), "stop",
                            limit=str(MAX_STOP_STRING_CHARS)),
        "one-string-too-long": refused(body(template, json.dumps("x" * (MAX_STOP_STRING_CHARS + 1))), "stop",
                                       limit=str(MAX_STOP_STRING_CHARS)),
    }  # fmt: skip


# What an answer is

JSON_HEADERS = {"content-type": "application/json"}


@dataclass
class Answer:
    status: int
    headers: httpx.Headers
    text: str  # the body; of a stream, up to its first event
    seconds: float

    def error(self) -> dict[str, Any]:
        return json.loads(self.text)["error"]


def post(
    http: httpx.Client, path: str, content: bytes | Iterator[bytes], *, stream: bool = False, timeout: float = 60
) -> Answer:
    """A raw POST (chunked, when `content` is an iterator); a stream is read up to its first event and then dropped
    (the server aborts it)."""
    started = time.monotonic()
    with http.stream("POST", path, content=content, headers=JSON_HEADERS, timeout=timeout) as response:
        if stream and response.status_code == 200:
            text = next((line for line in response.iter_lines() if line.startswith("data:")), "")
        else:
            text = response.read().decode()
    return Answer(response.status_code, response.headers, text, time.monotonic() - started)


def names(param: str | None, field: str | None) -> bool:
    """Whether an error's `param` names the field: the field itself, or a path into it."""
    if param is None or field is None:
        return param is field
    return param == field or param.startswith((f"{field}.", f"{field}["))


def assert_refused(answer: Answer, *fields: str | None) -> dict[str, Any]:
    """A 4xx in the OpenAI error shape naming one of `fields` (None: an error about the whole body, which then needs a
    body-level code); its message carries no Python exception text. Returns the error."""
    assert 400 <= answer.status < 500, f"{answer.status}: {answer.text[:500]}"
    error = answer.error()
    assert set(error) == {"message", "type", "param", "code"}, error
    assert any(names(error["param"], field) for field in fields), f"param {error['param']!r} is none of {fields}"
    if error["param"] is None:
        assert error["code"] in BODY_CODES, error
    assert error["code"] and error["message"], error
    assert not any(text in error["message"] for text in PYTHON_TEXT), error["message"][:500]
    if error["code"] == "request_too_large":
        assert answer.status == 413 and re.search(r"\d", error["message"]), error  # it names the limit
    return error


def assert_answered(answer: Answer) -> None:
    """A 200 with a generation in it (a stream's first event included), not an error."""
    assert answer.status == 200, f"{answer.status}: {answer.text[:500]}"
    event = json.loads(answer.text.removeprefix("data:").strip())
    # A Responses object carries "error": null.
    assert event.get("error") is None and event.get("type") != "response.failed", answer.text[:500]


def check(answer: Answer, case: Case) -> None:
    """The answer to a hostile case: refused naming one of its fields (and its limit), or its legal answer."""
    if case.legal is None or (case.legal is EITHER and answer.status != 200):
        error = assert_refused(answer, *case.fields)
        assert case.limit is None or case.limit in error["message"], f"the message does not name {case.limit}: {error}"
        return
    assert_answered(answer)
    if case.legal is CLAMPED:
        warning = answer.headers.get("warning", "")
        assert case.fields[0] in warning and "clamped" in warning, f"no Warning that the budget was clamped: {warning}"


def problems(send: Callable[[Case], Answer], cases: dict[str, Case], down: Callable[[], str | None]) -> dict[str, str]:
    """What is wrong with each case's answer (nothing, for a right one). `down` says how the engine is down after a
    case, or None: the group stops at the case that ended it."""
    found = {}
    for label, case in cases.items():
        try:
            check(send(case), case)
        except Exception as error:  # each wrong answer is reported, not only the first
            found[label] = f"{type(error).__name__}: {error}".splitlines()[0][:400]
        if (why := down()) is not None:
            found[label] = f"{found.get(label, 'answered right')}; then {why}"
            break
    return found


def report(found: dict[str, str]) -> str:
    return "wrong answers:\n" + "\n".join(f"  {label}: {problem}" for label, problem in found.items())


@dataclass
class Overlap:
    hostile: Answer
    normal_s: float  # how long the normal request took while the hostile one was in flight


def alongside(hostile: Callable[[], Answer], normal: Callable[[], object]) -> Overlap:
    """Sends `hostile` on a thread and, once it is in flight, `normal`, timed."""
    answers: list[Answer | BaseException] = []

    def send() -> None:
        try:
            answers.append(hostile())
        except BaseException as error:  # shown by the assertion below
            answers.append(error)

    thread = threading.Thread(target=send)
    thread.start()
    try:
        time.sleep(IN_FLIGHT_S)
        started = time.monotonic()
        normal()
        normal_s = time.monotonic() - started
    finally:
        thread.join()
    assert isinstance(answers[0], Answer), f"the hostile request got no answer: {answers[0]!r}"
    return Overlap(answers[0], normal_s)
