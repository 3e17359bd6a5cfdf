"""DSML output parsing: every parse vector (reference §12), whole and streamed in every split, and crafted cases for
split markers, malformed calls, parallel calls, unicode and completions without tools."""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from engine.llm_engine import RequestOutput
from engine.server.chat_encoding import DSML, EOS, encode_messages
from engine.server.completions import client_finish_reason
from engine.server.dsml import (
    ContentDelta,
    Malformed,
    ParsedCompletion,
    ReasoningDelta,
    StreamEvent,
    StreamingParser,
    ToolCall,
    parse_output,
)

VECTORS_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "dsv4_chat_vectors.json"
VECTORS_MISSING = f"conformance vectors not found at {VECTORS_PATH} (the shared/ folder beside the repository)"
PARSE_VECTORS: dict[str, dict[str, Any]] = (
    {v["name"]: v for v in json.loads(VECTORS_PATH.read_text(encoding="utf-8")) if v["kind"] == "parse"}
    if VECTORS_PATH.exists()
    else {}
)

# Vectors the reference rejects (or passes through invalid JSON), and the tolerant result this parser gives:
# (reasoning, content, number of dropped regions). None of them may yield a tool call (§12).
TOLERATED = {
    "parse_error_missing_eos": ("", "Truncated answer without end", 0),
    "parse_error_missing_think_close": ("Still thinking and never closed", "", 0),
    "parse_error_tool_calls_inside_reasoning": ("thinking...", "", 1),
    "parse_error_tool_calls_without_blank_line": ("", "", 1),
    "parse_error_duplicate_parameter": ("", "", 1),
    "parse_error_text_after_tool_calls": ("", "\nDone.", 1),
    "parse_error_bad_string_attribute": ("", "", 1),
    "parse_error_special_token_in_content": ("", "Use <think> tags.", 0),
    "parse_string_false_invalid_json_passthrough": ("", "", 1),
}


def _parse_vector_params(*, tolerated: bool) -> list[Any]:
    if not PARSE_VECTORS:
        return [pytest.param(None, marks=pytest.mark.skip(reason=VECTORS_MISSING), id="vectors-missing")]
    return [pytest.param(name, id=name) for name in PARSE_VECTORS if (name in TOLERATED) == tolerated]


def _input(name: str) -> tuple[str, bool]:
    given = PARSE_VECTORS[name]["input"]
    return given["text"], given["thinking_mode"] == "thinking"


def _counting_ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def _collect(events: Iterable[StreamEvent]) -> ParsedCompletion:
    result = ParsedCompletion()
    for event in events:
        if isinstance(event, ReasoningDelta):
            result.reasoning += event.text
        elif isinstance(event, ContentDelta):
            result.content += event.text
        elif isinstance(event, ToolCall):
            result.tool_calls.append(event)
        else:
            result.malformed.append(event)
    return result


def _stream(pieces: Iterable[str], *, tools_offered: bool = True, thinking: bool = False) -> list[StreamEvent]:
    parser = StreamingParser(tools_offered=tools_offered, thinking=thinking, call_id=_counting_ids())
    events = [event for piece in pieces for event in parser.feed(piece)]
    return events + parser.finish()


def _parse(text: str, *, tools_offered: bool = True, thinking: bool = False) -> ParsedCompletion:
    return parse_output(text, tools_offered, thinking, call_id=_counting_ids())


def _splits(text: str) -> Iterable[list[str]]:
    """Single characters, every cut into two, and random chunk sizes with fixed seeds."""
    yield list(text)
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for seed in range(8):
        rng, pieces, start = random.Random(seed), [], 0
        while start < len(text):
            size = rng.randint(1, 16)
            pieces.append(text[start : start + size])
            start += size
        yield pieces


def _assert_streaming_matches(text: str, *, tools_offered: bool = True, thinking: bool = False) -> ParsedCompletion:
    whole = _parse(text, tools_offered=tools_offered, thinking=thinking)
    for pieces in _splits(text):
        events = _stream(pieces, tools_offered=tools_offered, thinking=thinking)
        assert all(event.text for event in events if isinstance(event, ReasoningDelta | ContentDelta))
        assert _collect(events) == whole, f"split {pieces!r}"
    return whole


def _assert_clean(result: ParsedCompletion) -> None:
    """No markup in what a client sees, and arguments that are JSON objects."""
    assert DSML not in result.reasoning and DSML not in result.content
    for call in result.tool_calls:
        assert DSML not in call.arguments
        assert isinstance(json.loads(call.arguments), dict)


def test_parse_vectors_are_present():
    if not PARSE_VECTORS:
        pytest.skip(VECTORS_MISSING)
    assert len(PARSE_VECTORS) == 22
    assert set(TOLERATED) <= set(PARSE_VECTORS)


@pytest.mark.parametrize("name", _parse_vector_params(tolerated=False))
@pytest.mark.parametrize("with_eos", [True, False], ids=["with-eos", "eos-stripped"])
def test_parse_vector_is_reproduced(name, with_eos):
    text, thinking = _input(name)
    expected = PARSE_VECTORS[name]["expected"]
    result = _parse(text if with_eos else text.removesuffix(EOS), thinking=thinking)
    assert (result.reasoning, result.content, result.malformed) == (
        expected["reasoning_content"],
        expected["content"],
        [],
    )
    calls = [(call["function"]["name"], call["function"]["arguments"]) for call in expected["tool_calls"]]
    assert [(call.name, call.arguments) for call in result.tool_calls] == calls
    for call, (_, arguments) in zip(result.tool_calls, calls, strict=True):
        assert json.loads(call.arguments) == json.loads(arguments)
    assert [call.index for call in result.tool_calls] == list(range(len(calls)))
    _assert_clean(result)


@pytest.mark.parametrize("name", _parse_vector_params(tolerated=True))
def test_rejected_parse_vector_gives_a_content_only_result(name):
    text, thinking = _input(name)
    assert "error" in PARSE_VECTORS[name]["expected"] or name == "parse_string_false_invalid_json_passthrough"
    result = _parse(text, thinking=thinking)
    assert (result.reasoning, result.content, len(result.malformed)) == TOLERATED[name]
    assert result.tool_calls == []
    assert all(DSML in dropped.text for dropped in result.malformed)
    _assert_clean(result)


@pytest.mark.parametrize("name", _parse_vector_params(tolerated=False) + _parse_vector_params(tolerated=True))
@pytest.mark.parametrize("tools_offered", [True, False], ids=["tools", "no-tools"])
def test_parse_vector_streamed_in_every_split_equals_the_whole_parse(name, tools_offered):
    text, thinking = _input(name)
    result = _assert_streaming_matches(text, tools_offered=tools_offered, thinking=thinking)
    if tools_offered:
        _assert_clean(result)


@pytest.mark.parametrize("name", _parse_vector_params(tolerated=False) + _parse_vector_params(tolerated=True))
def test_without_tools_offered_markup_is_plain_content(name):
    text, thinking = _input(name)
    result = _parse(text, tools_offered=False, thinking=thinking)
    answer = text.split(EOS)[0]
    reasoning, closed, content = answer.partition("</think>") if thinking else ("", "", answer)
    expected = (reasoning, content) if closed or not thinking else (answer, "")
    assert (result.reasoning, result.content, result.tool_calls, result.malformed) == (*expected, [], [])


def _block(*invokes: str) -> str:
    return f"\n\n<{DSML}tool_calls>\n" + "\n".join(invokes) + f"\n</{DSML}tool_calls>"


def _invoke(name: str, *parameters: tuple[str, str, str]) -> str:
    lines = [
        f'<{DSML}parameter name="{key}" string="{kind}">{value}</{DSML}parameter>' for key, kind, value in parameters
    ]
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(lines) + f"\n</{DSML}invoke>"


WEATHER = _invoke("get_weather", ("city", "true", "Oslo"))
SEARCH = _invoke("search", ("query", "true", "rain gear"), ("limit", "false", "3"))


def test_content_streams_without_waiting_for_the_end():
    parser = StreamingParser(tools_offered=True, thinking=False)
    assert parser.feed("Hello wor") == [ContentDelta("Hello wor")]
    assert parser.feed("ld <") == [ContentDelta("ld ")]  # "<" may open EOS or a DSML tag
    assert parser.feed("b>") == [ContentDelta("<b>")]
    assert parser.feed("\n") == []  # may open the blank line before a block
    assert parser.feed("x") == [ContentDelta("\nx")]
    assert parser.finish() == []


def test_markers_split_across_deltas_never_leak():
    parser = StreamingParser(tools_offered=True, thinking=True, call_id=_counting_ids())
    assert parser.feed("Plan: call it</th") == [ReasoningDelta("Plan: call it")]
    assert parser.feed("ink>Checking.\n") == [ContentDelta("Checking.")]
    assert parser.feed("\n<｜DS") == []
    assert parser.feed("ML｜tool_calls>\n" + WEATHER) == []
    assert parser.feed(f"\n</{DSML}tool_ca") == []
    assert parser.feed("lls>") == []  # a call is only certain once EOS (or the end) follows the block
    assert parser.feed("<｜end▁of") == []
    assert parser.feed("▁sentence｜>") == [ToolCall(0, "call_0", "get_weather", '{"city": "Oslo"}')]
    assert parser.finish() == []


def test_a_call_is_emitted_at_the_end_of_text_when_eos_was_stripped():
    parser = StreamingParser(tools_offered=True, thinking=False, call_id=_counting_ids())
    assert parser.feed(_block(WEATHER)) == []
    assert parser.finish() == [ToolCall(0, "call_0", "get_weather", '{"city": "Oslo"}')]


def test_calls_after_reasoning():
    result = _assert_streaming_matches(f"The user wants weather.</think>{_block(WEATHER)}{EOS}", thinking=True)
    assert (result.reasoning, result.content) == ("The user wants weather.", "")
    assert [(call.name, call.arguments) for call in result.tool_calls] == [("get_weather", '{"city": "Oslo"}')]


def test_parallel_calls_get_distinct_index_and_id():
    text = f"Both at once.{_block(WEATHER, SEARCH, WEATHER)}{EOS}"
    result = parse_output(text, True, False)
    assert [call.index for call in result.tool_calls] == [0, 1, 2]
    assert len({call.id for call in result.tool_calls}) == 3
    assert all(call.id.startswith("call_") for call in result.tool_calls)
    assert result.tool_calls[1].arguments == '{"query": "rain gear", "limit": 3}'
    assert result.content == "Both at once."


def test_whitespace_between_the_block_and_eos_is_allowed():
    result = _assert_streaming_matches(f"{_block(WEATHER)}\n {EOS}")
    assert [call.name for call in result.tool_calls] == ["get_weather"]


def test_parsing_resumes_after_dropped_markup():
    stray = f'<{DSML}invoke name="f">\n</{DSML}invoke>\n</{DSML}tool_calls>'
    result = _assert_streaming_matches(f"Sure.{stray} Calling now.{_block(SEARCH)}{EOS}")
    assert result.content == "Sure. Calling now."
    assert [call.name for call in result.tool_calls] == ["search"]
    assert [dropped.text for dropped in result.malformed] == [stray]


MALFORMED = {
    "invoke not closed": _block(
        f'<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1</{DSML}parameter>'
    ),
    "parameter not closed": _block(
        f'<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">1\n'
        f'<{DSML}parameter name="b" string="true">2</{DSML}parameter>\n</{DSML}invoke>'
    ),
    "bad string attribute": _block(_invoke("f", ("a", "yes", "1"))),
    "curly quotes": _block(f"<{DSML}invoke name=“f”>\n</{DSML}invoke>"),
    "empty tool name": _block(_invoke("", ("a", "true", "1"))),
    "duplicate parameter": _block(_invoke("f", ("a", "true", "1"), ("a", "true", "2"))),
    "value not JSON": _block(_invoke("f", ("a", "false", "hello"))),
    "NaN is not JSON": _block(_invoke("f", ("a", "false", "NaN"))),
    "value smuggling a key": _block(_invoke("f", ("a", "false", '1, "admin": true'))),
    "one bad call sinks the block": _block(WEATHER, _invoke("f", ("a", "false", "{oops"))),
    "no blank line": _block(WEATHER).removeprefix("\n\n"),
    "single newline": "Checking:" + _block(WEATHER).removeprefix("\n"),
    "doubled bars": 'Checking:\n\n<｜｜DSML｜｜tool_calls>\n<｜｜DSML｜｜invoke name="f">\n</｜｜DSML｜｜invoke>',
    "stray closing tag": f"a</{DSML}parameter>",
    "cut short": "Checking:" + _block(WEATHER)[:60],
    "text after the block": _block(WEATHER) + "Done.",
}


@pytest.mark.parametrize("text", MALFORMED.values(), ids=MALFORMED.keys())
def test_malformed_calls_are_dropped_and_reported_never_emitted(text):
    result = _assert_streaming_matches(text + EOS)
    assert result.tool_calls == []
    assert result.malformed
    assert all(DSML.strip("｜") in dropped.text for dropped in result.malformed)
    _assert_clean(result)
    assert result.content.strip() in ("", "Checking:", "a", "Done.")


def test_markup_inside_reasoning_is_dropped():
    result = _assert_streaming_matches(f"Maybe{_block(WEATHER)} no.</think>Answer.{EOS}", thinking=True)
    assert (result.reasoning, result.content, result.tool_calls) == ("Maybe no.", "Answer.", [])
    assert [dropped.reason for dropped in result.malformed] == ["DSML markup inside the reasoning"]


def test_no_tools_offered_leaves_markup_as_content():
    text = f"Thinking.</think>Here:{_block(WEATHER)}"
    result = _assert_streaming_matches(text + EOS, tools_offered=False, thinking=True)
    assert (result.reasoning, result.content, result.tool_calls, result.malformed) == (
        "Thinking.",
        "Here:" + _block(WEATHER),
        [],
        [],
    )


def test_unicode_content_and_arguments():
    call = _invoke("translate", ("text", "true", "你好，世界 🌍"), ("n", "false", '[1, "ü"]'))
    result = _assert_streaming_matches(f"日本語 — naïve 😊 é{_block(call)}{EOS}")
    assert result.content == "日本語 — naïve 😊 é"
    assert result.tool_calls[0].arguments == '{"text": "你好，世界 🌍", "n": [1, "ü"]}'


def test_text_after_eos_is_dropped_and_reported():
    result = _assert_streaming_matches(f"Hi{EOS}more")
    assert result.content == "Hi"
    assert result.malformed == [Malformed("more", "text after the end of sentence")]


def test_thinking_that_never_closes_is_all_reasoning():
    parser = StreamingParser(tools_offered=True, thinking=True)
    assert parser.feed("Still going") == [ReasoningDelta("Still going")]
    assert parser.finish() == []


def test_feed_after_finish_is_an_error():
    parser = StreamingParser(tools_offered=True, thinking=False)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_encoded_history_parses_back_to_the_same_calls():
    arguments = {
        "path": 'notes/a "b".txt',
        "body": "line1\n  if a < b:\n\treturn 'x\\\\y'\n",
        "n": 2.5,
        "o": {"k": [None]},
    }
    calls = [
        {"id": "1", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(arguments)}},
        {"id": "2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    history = [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "On it.", "tool_calls": calls}]
    prompt = encode_messages(history, "chat")
    completion = prompt.split("<｜Assistant｜></think>", 1)[1]
    result = _assert_streaming_matches(completion)
    assert result.content == "On it."
    assert [(call.name, json.loads(call.arguments)) for call in result.tool_calls] == [
        ("write_file", arguments),
        ("get_time", {}),
    ]


@pytest.mark.parametrize(
    ("engine_reason", "tool_calls", "reason"),
    [("stop", True, "tool_calls"), ("length", True, "tool_calls"), ("length", False, "length"),
     ("timeout", False, "length"), ("stop", False, "stop")],
)  # fmt: skip
def test_client_finish_reason(engine_reason, tool_calls, reason):
    output = RequestOutput("r", [1], "", [], None, engine_reason)
    assert client_finish_reason(output, tool_calls) == reason
