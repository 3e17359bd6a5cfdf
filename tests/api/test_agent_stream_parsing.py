"""Markup never leaks, as the server streams it: crafted completions (calls after reasoning, parallel calls, malformed
calls, markup in the reasoning, a cut block, tool_choice "none") are decoded token by token with the tiny tokenizer,
and again one character at a time so that every marker is split across chunks, and fed through the chat and the
Responses formatters exactly as the server feeds engine outputs. Every stream must meet the agents' contract
(qualification.md §3.3) and carry what the whole response carries."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.llm_engine import RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.chat_encoding import EOS
from engine.server.completions import ChatFormatter
from engine.server.protocol import GenerationRequest
from engine.server.responses_api import ResponsesFormatter
from engine.tokenizer import Tokenizer
from engine.tools.tiny_tokenizer import build_tiny_tokenizer

FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}
# What leaked markup looks like (qualification.md §3.6: DSML, "<|", "function=", U+FFFD).
LEAKS = ("DSML", "<｜", "｜>", "<|", "function=", "invoke name", "parameter name", "\ufffd")


def call(name: str, **params: tuple[str, bool]) -> str:
    lines = [
        f'<｜DSML｜parameter name="{key}" string="{"true" if raw else "false"}">{value}</｜DSML｜parameter>'
        for key, (value, raw) in params.items()
    ]
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(lines) + "\n</｜DSML｜invoke>"


def block(*calls: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "\n".join(calls) + "\n</｜DSML｜tool_calls>"


PARIS = call("get_weather", city=("Paris", True))


@dataclass
class Case:
    text: str  # the completion as the model writes it
    thinking: bool = False
    tools: bool = True
    calls_allowed: bool = True
    cut: bool = False  # the length limit ends it (no EOS)
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


CASES = {
    "call-after-reasoning": Case(
        "The user wants weather.</think>" + block(PARIS) + EOS,
        thinking=True,
        reasoning="The user wants weather.",
        calls=[("get_weather", {"city": "Paris"})],
    ),
    "content-then-parallel-calls": Case(
        "Checking both." + block(PARIS, call("get_time", tz=("UTC", True), offset=("-2.5", False))) + EOS,
        content="Checking both.",
        calls=[("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC", "offset": -2.5})],
    ),
    "raw-text-with-specials": Case(
        block(call("write", path=("a.py", True), body=('if a < b:\n    print("é ☀️ </think>")', True))) + EOS,
        calls=[("write", {"path": "a.py", "body": 'if a < b:\n    print("é ☀️ </think>")'})],
    ),
    "json-values": Case(
        block(call("edit", lines=('["x", "y"]', False), opts=('{"force": true, "n": null}', False))) + EOS,
        calls=[("edit", {"lines": ["x", "y"], "opts": {"force": True, "n": None}})],
    ),
    "missing-invoke-close": Case("Hm." + block(PARIS).replace("\n</｜DSML｜invoke>", "") + EOS, content="Hm."),
    "invalid-json-value": Case(block(call("f", n=("{oops", False))) + EOS),
    # Not a block start, so its blank line stays content; the markup goes.
    "doubled-bars": Case("Ok" + block(PARIS).replace("｜DSML｜", "｜｜DSML｜｜") + EOS, content="Ok\n\n"),
    "markup-without-blank-line": Case("Sure" + block(PARIS)[2:] + EOS, content="Sure"),
    "markup-inside-reasoning": Case(
        "Think " + block(PARIS) + " more</think>Answer." + EOS,
        thinking=True,
        reasoning="Think  more",
        content="Answer.",
    ),
    "block-cut-by-length": Case("Let me see." + block(PARIS)[:40], cut=True, content="Let me see."),
    "text-after-block": Case(block(PARIS) + "\nDone." + EOS, content="\nDone."),
    "tool-choice-none": Case("Fine." + block(PARIS) + EOS, calls_allowed=False, content="Fine."),
    "reasoning-only-cut": Case(
        "Still thinking about <｜DSML｜", thinking=True, cut=True, reasoning="Still thinking about "
    ),
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer())


def request(case: Case) -> GenerationRequest:
    return GenerationRequest(
        [0], SamplingParams(), True, True, None, case.thinking, case.tools, case.calls_allowed, echo={}
    )


def outputs(tokenizer: Tokenizer, case: Case, by_character: bool) -> list[RequestOutput]:
    """The engine's outputs for this completion: one per token (the detokenizer drops EOS, as the engine's does),
    or one per character of the decoded text."""
    ids = tokenizer.encode(case.text)
    detokenizer = tokenizer.detokenizer()
    deltas = [detokenizer.step(token) for token in ids]
    deltas[-1] += detokenizer.flush()
    if by_character:
        deltas = list("".join(deltas))
    result, text = [], ""
    for i, delta in enumerate(deltas):
        text += delta
        last = i == len(deltas) - 1
        reason = ("length" if case.cut else "stop") if last else None
        result.append(RequestOutput("req", [0], text, ids, None, reason, new_text=delta, new_token_ids=(ids[0],)))
    return result


def chat_stream(tokenizer: Tokenizer, case: Case, by_character: bool) -> tuple[list[dict], dict]:
    fmt = ChatFormatter("chatcmpl-1", "tiny", request(case), tokenizer)
    given = outputs(tokenizer, case, by_character)
    chunks = fmt.opening() + [chunk for output in given for chunk in fmt.events(output)]
    whole = ChatFormatter("chatcmpl-2", "tiny", request(case), tokenizer).response(given[-1])
    return chunks, whole


@pytest.mark.parametrize("by_character", [False, True], ids=["by-token", "by-character"])
@pytest.mark.parametrize("name", list(CASES))
def test_chat_stream_meets_the_contract_and_leaks_no_markup(tokenizer, name, by_character):
    case = CASES[name]
    chunks, whole = chat_stream(tokenizer, case, by_character)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert (reasoning, content) == (case.reasoning, case.content)
    for leak in LEAKS:
        assert leak not in reasoning and leak not in content
    fragments = [t for d in deltas for t in d.get("tool_calls", [])]
    # Each call arrives whole, once: id, type and name on its first (only) fragment; distinct index and id.
    assert [f["index"] for f in fragments] == list(range(len(case.calls)))
    assert len({f["id"] for f in fragments}) == len(fragments) and all(f["id"].startswith("call_") for f in fragments)
    assert all(f["type"] == "function" for f in fragments)
    assert [(f["function"]["name"], json.loads(f["function"]["arguments"])) for f in fragments] == case.calls
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    expected = "tool_calls" if case.calls else "length" if case.cut else "stop"
    assert reasons == [expected] and chunks[-2]["choices"][0]["finish_reason"] == expected
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0
    # The whole response says the same.
    message = whole["choices"][0]["message"]
    assert message["content"] == (case.content or (None if case.calls else ""))
    assert message.get("reasoning_content", "") == case.reasoning
    got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]
    assert got == case.calls and whole["choices"][0]["finish_reason"] == expected


def test_without_tools_markup_is_plain_content(tokenizer):
    text = "Use " + block(PARIS) + EOS
    chunks, whole = chat_stream(tokenizer, Case(text, tools=False), by_character=True)
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert content == whole["choices"][0]["message"]["content"] == text[: -len(EOS)]
    assert whole["choices"][0]["finish_reason"] == "stop"


@pytest.mark.parametrize("by_character", [False, True], ids=["by-token", "by-character"])
@pytest.mark.parametrize("name", list(CASES))
def test_responses_stream_meets_the_contract_and_leaks_no_markup(tokenizer, name, by_character):
    case = CASES[name]
    fmt = ResponsesFormatter("resp-1", "tiny", request(case), tokenizer)
    given = outputs(tokenizer, case, by_character)
    events = fmt.opening() + [event for output in given for event in fmt.events(output)]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[0]["type"] == "response.created" and events[1]["type"] == "response.in_progress"
    final = events[-1]
    assert final["type"] == ("response.incomplete" if case.cut else "response.completed")
    assert [
        e for e in events if e["type"].startswith("response.") and e["type"].endswith(("completed", "incomplete"))
    ] == [final]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert added == [e["output_index"] for e in done] == list(range(len(done)))
    assert final["response"]["output"] == [e["item"] for e in done]
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    summary = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    assert (summary, text) == (case.reasoning, case.content)
    for leak in LEAKS:
        assert leak not in text and leak not in summary
    calls = [e["item"] for e in done if e["item"]["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == case.calls
    arguments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert arguments == [c["arguments"] for c in calls] and len({c["call_id"] for c in calls}) == len(calls)
    whole = ResponsesFormatter("resp-2", "tiny", request(case), tokenizer).response(given[-1])
    shape = [(i["type"], i.get("arguments"), json.dumps(i.get("content"))) for i in whole["output"]]
    assert shape == [(i["type"], i.get("arguments"), json.dumps(i.get("content"))) for i in final["response"]["output"]]
    assert whole["status"] == final["response"]["status"] and whole["usage"] == final["response"]["usage"]
    assert fmt.sse(events[0]).startswith("event: response.created\ndata: {") and fmt.closing() == ""
