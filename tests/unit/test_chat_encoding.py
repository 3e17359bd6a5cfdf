"""DeepSeek-V4 chat encoding: every encode vector byte for byte (reference §12), the §11 corrections rendered as
the reference says a fixed encoder should, and crafted cases for validation, profiles and content shapes."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from engine.server.chat_encoding import BOS, EOS, ChatEncodingError, encode_messages

VECTORS_PATH = Path(__file__).resolve().parents[3] / "shared" / "data" / "dsv4_chat_vectors.json"
VECTORS_MISSING = f"conformance vectors not found at {VECTORS_PATH} (the shared/ folder beside the repository)"
VECTORS: dict[str, dict[str, Any]] = (
    {vector["name"]: vector for vector in json.loads(VECTORS_PATH.read_text(encoding="utf-8"))}
    if VECTORS_PATH.exists()
    else {}
)
PROFILES = {"v4-preview": "preview", "v4-0731": "0731"}

P1_START = "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
P2_START = "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def _vector(name: str) -> dict[str, Any]:
    if not VECTORS:
        pytest.skip(VECTORS_MISSING)
    return VECTORS[name]


def _encode_vector(vector: dict[str, Any]) -> str:
    given = vector["input"]
    return encode_messages(
        given["messages"],
        given["thinking_mode"],
        context=given["context"],
        drop_thinking=given["drop_thinking"],
        add_default_bos_token=given["add_default_bos_token"],
        reasoning_effort=given["reasoning_effort"],
        profile=PROFILES[vector["profile"]],
    )


def _replace_once(text: str, old: str, new: str) -> str:
    assert text.count(old) == 1, f"{old!r} should occur once"
    return text.replace(old, new)


# §11/§12: vectors where the reference is wrong or doubtful, and the prompt this encoder renders instead.
CORRECTED: dict[str, Callable[[], str]] = {
    # §11.3: "low" is never an error; on the preview profile it adds nothing, exactly like "high".
    "reasoning_effort_low_rejected_preview": lambda: _vector("reasoning_effort_high_thinking_preview")["expected"],
    # §11.1: arguments already parsed into an object render like the JSON-string form, one parameter per key.
    "BUG_tool_call_arguments_already_dict_nonthinking": lambda: _vector(
        "tool_call_arguments_json_string_form_of_bug_case_nonthinking"
    )["expected"],
    # §11.2: JSON that is not an object renders verbatim as one string parameter, as invalid JSON already does.
    "tool_call_arguments_json_scalar_crashes": lambda: _replace_once(
        _vector("tool_call_arguments_not_json_nonthinking")["expected"], ">city=Paris<", ">42<"
    ),
    # §11.2: empty or null arguments render as a call without parameters (the encoder's blank-line form).
    "tool_call_arguments_empty_string_nonthinking": lambda: _replace_once(
        _vector("tool_call_arguments_empty_string_nonthinking")["expected"],
        '<｜DSML｜parameter name="arguments" string="true"></｜DSML｜parameter>',
        "",
    ),
    "tool_call_arguments_null_value_nonthinking": lambda: _replace_once(
        _vector("tool_call_arguments_null_value_nonthinking")["expected"],
        '<｜DSML｜parameter name="arguments" string="false">null</｜DSML｜parameter>',
        "",
    ),
}


def _encode_vector_params(*, corrected: bool) -> list[Any]:
    if not VECTORS:
        return [pytest.param(None, marks=pytest.mark.skip(reason=VECTORS_MISSING), id="vectors-missing")]
    return [
        pytest.param(name, id=name)
        for name, vector in VECTORS.items()
        if vector["kind"] == "encode" and (name in CORRECTED) == corrected
    ]


def test_vectors_file_has_the_documented_shape():
    if not VECTORS:
        pytest.skip(VECTORS_MISSING)
    kinds = [vector["kind"] for vector in VECTORS.values()]
    assert (len(VECTORS), kinds.count("encode"), kinds.count("parse")) == (76, 54, 22)
    assert set(CORRECTED) <= set(VECTORS)


@pytest.mark.parametrize("name", _encode_vector_params(corrected=False))
def test_encode_vector_is_reproduced_byte_for_byte(name):
    vector = _vector(name)
    if isinstance(vector["expected"], dict):
        with pytest.raises(ChatEncodingError):
            _encode_vector(vector)
    else:
        assert _encode_vector(vector) == vector["expected"]


@pytest.mark.parametrize("name", _encode_vector_params(corrected=True))
def test_encode_vector_marked_as_bug_renders_the_corrected_prompt(name):
    vector = _vector(name)
    corrected = CORRECTED[name]()
    assert corrected != vector["expected"], "the correction must differ from the reference's output"
    assert _encode_vector(vector) == corrected


def test_dict_arguments_render_like_their_json_string():
    arguments = {"path": "a/b.txt", "lines": [1, 2.5], "options": {"ünï": None, "deep": True}, "note": "日本"}

    def conversation(value: Any) -> list[dict[str, Any]]:
        call = {"id": "c", "type": "function", "function": {"name": "edit", "arguments": value}}
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": "", "tool_calls": [call]}]

    as_object = encode_messages(conversation(arguments), "chat")
    assert as_object == encode_messages(conversation(json.dumps(arguments)), "chat")
    assert (
        '<｜DSML｜parameter name="options" string="false">{"ünï": null, "deep": true}</｜DSML｜parameter>' in as_object
    )
    assert 'name="arguments"' not in as_object


@pytest.mark.parametrize(
    ("arguments", "parameters"),
    [
        ("[1, 2]", '\n<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>\n'),
        ('"hi"', '\n<｜DSML｜parameter name="arguments" string="true">"hi"</｜DSML｜parameter>\n'),
        ("null", "\n\n"),
        ("  ", "\n\n"),
        ("{}", "\n\n"),
    ],
)
def test_arguments_that_are_not_an_object(arguments, parameters):
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    prompt = encode_messages([{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [call]}], "chat")
    assert prompt.endswith(f'<｜DSML｜invoke name="f">{parameters}</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}')


QUESTION = [{"role": "system", "content": "S."}, {"role": "user", "content": "Why?"}]


def test_default_profile_is_0731():
    assert encode_messages(QUESTION, "thinking", reasoning_effort="high") == encode_messages(
        QUESTION, "thinking", reasoning_effort="high", profile="0731"
    )
    assert encode_messages(QUESTION, "thinking", reasoning_effort="high").startswith(BOS + P1_START)
    assert encode_messages(QUESTION, "thinking", reasoning_effort="max").startswith(BOS + P2_START)


@pytest.mark.parametrize("profile", ["0731", "preview"])
@pytest.mark.parametrize("mode", ["thinking", "chat"])
def test_low_effort_is_never_an_error_and_adds_nothing(profile, mode):
    assert encode_messages(QUESTION, mode, reasoning_effort="low", profile=profile) == encode_messages(
        QUESTION, mode, profile=profile
    )


def test_0731_levels_give_three_distinct_prompts():
    prompts = {level: encode_messages(QUESTION, "thinking", reasoning_effort=level) for level in ("low", "high", "max")}
    assert len(set(prompts.values())) == 3
    assert prompts["low"] == f"{BOS}S.<｜User｜>Why?<｜Assistant｜><think>"


@pytest.mark.parametrize(("alias", "level"), [("minimal", "low"), ("medium", "high"), ("xhigh", "max")])
def test_effort_aliases_map_to_the_nearest_level(alias, level):
    assert encode_messages(QUESTION, "thinking", reasoning_effort=alias) == encode_messages(
        QUESTION, "thinking", reasoning_effort=level
    )


def test_effort_prefix_is_never_added_to_a_context_continuation():
    context = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    prompt = encode_messages([{"role": "user", "content": "More"}], "thinking", context=context, reasoning_effort="max")
    assert prompt == "<｜User｜>More<｜Assistant｜><think>"


def test_context_renders_exactly_the_new_messages_even_when_dropping_removes_a_context_message():
    # The reference counts the dropped context twice here and renders nothing at all.
    context = [{"role": "system", "content": "S."}, {"role": "developer", "content": "Old rules."}]
    prompt = encode_messages([{"role": "user", "content": "Next"}], "thinking", context=context)
    assert prompt == "<｜User｜>Next<｜Assistant｜><think>"


def _tool_loop() -> list[dict[str, Any]]:
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    return [
        {"role": "system", "content": "S.", "tools": [WEATHER_TOOL]},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "reasoning_content": "Use the tool.", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "rain"},
        {"role": "assistant", "reasoning_content": "Report it.", "content": "Rain in Oslo."},
        {"role": "user", "content": "Thanks"},
    ]


@pytest.mark.parametrize("mode", ["chat", "thinking"])
@pytest.mark.parametrize("cut", [2, 3, 4, 5])
def test_prompts_only_grow_in_chat_mode_and_with_tools(mode, cut):
    messages = _tool_loop()
    whole = encode_messages(messages, mode)
    before = encode_messages(messages[:cut], mode)
    assert whole == before + encode_messages(messages[cut:], mode, context=messages[:cut])
    assert whole.startswith(before)


def test_thinking_without_tools_rewrites_the_previous_turn():
    history = [{"role": "user", "content": "Q1"}, {"role": "assistant", "reasoning_content": "R.", "content": "A."}]
    before = encode_messages(history, "thinking")
    after = encode_messages([*history, {"role": "user", "content": "Q2"}], "thinking")
    assert before == f"{BOS}<｜User｜>Q1<｜Assistant｜><think>R.</think>A.{EOS}"
    assert after == f"{BOS}<｜User｜>Q1<｜Assistant｜></think>A.{EOS}<｜User｜>Q2<｜Assistant｜><think>"


def test_empty_tools_list_declares_nothing_and_keeps_dropping():
    messages = [
        {"role": "system", "content": "S.", "tools": []},
        {"role": "user", "content": "A"},
        {"role": "assistant", "reasoning_content": "old thoughts", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    prompt = encode_messages(messages, "thinking")
    assert "## Tools" not in prompt
    assert "old thoughts" not in prompt
    assert prompt == encode_messages([{**messages[0], "tools": None}, *messages[1:]], "thinking")


def test_tools_on_a_user_message_render_nowhere_but_keep_reasoning():
    messages = [
        {"role": "user", "content": "A", "tools": [WEATHER_TOOL]},
        {"role": "assistant", "reasoning_content": "kept", "content": "B"},
        {"role": "user", "content": "C"},
    ]
    prompt = encode_messages(messages, "thinking")
    assert "## Tools" not in prompt
    assert "<｜User｜>A<｜Assistant｜><think>kept</think>B" in prompt


def test_content_given_as_text_parts():
    parts = [{"type": "text", "text": "Line one."}, {"type": "text", "text": "Line two."}]
    as_parts = encode_messages([{"role": "user", "content": parts}, {"role": "assistant", "content": parts}], "chat")
    joined = "Line one.\n\nLine two."
    assert as_parts == encode_messages(
        [{"role": "user", "content": joined}, {"role": "assistant", "content": joined}], "chat"
    )
    assert as_parts == f"{BOS}<｜User｜>{joined}<｜Assistant｜></think>{joined}{EOS}"


@pytest.mark.parametrize("field", ["reasoning", "reasoning_text"])
def test_prior_reasoning_under_other_field_names(field):
    def conversation(name: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "Q"}, {"role": "assistant", name: "because", "content": "A"}]

    prompt = encode_messages(conversation(field), "thinking")
    assert prompt == encode_messages(conversation("reasoning_content"), "thinking")
    assert prompt.endswith("<think>because</think>A" + EOS)


def test_reasoning_content_wins_over_other_field_names():
    assistant = {"role": "assistant", "reasoning_content": "first", "reasoning": "second", "content": "A"}
    assert "<think>first</think>A" in encode_messages([{"role": "user", "content": "Q"}, assistant], "thinking")


def test_unicode_is_written_literally():
    messages = [
        {"role": "system", "content": "Réponds — 日本語 🌍", "tools": [WEATHER_TOOL]},
        {"role": "user", "content": "😊"},
    ]
    prompt = encode_messages(messages, "chat")
    assert "Réponds — 日本語 🌍\n\n## Tools" in prompt
    assert "\\u" not in prompt


def test_input_messages_are_not_modified():
    messages = _tool_loop()
    messages.insert(4, {"role": "tool", "tool_call_id": "zz", "content": [{"type": "text", "text": "x"}]})
    snapshot = copy.deepcopy(messages)
    encode_messages(messages, "thinking", context=None)
    assert messages == snapshot


CALL = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([{"role": "critic", "content": "x"}], "messages[0].role"),
        ([{"content": "x"}], "messages[0].role"),
        (["hello"], "messages[0]"),
        ([{"role": "user", "content": "x"}, {"role": "developer", "content": ""}], "messages[1].content"),
        ([{"role": "user", "content": 42}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
            "messages[0].content[0].type",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 7}]}], "messages[0].content[0].text"),
        ([{"role": "user", "content": "x", "task": "summarise"}], "messages[0].task"),
        ([{"role": "system", "content": "", "tools": [{"type": "function"}]}], "messages[0].tools[0].function"),
        ([{"role": "system", "content": "", "tools": {"f": 1}}], "messages[0].tools"),
        ([{"role": "assistant", "tool_calls": [{"type": "function"}]}], "messages[0].tool_calls[0].function"),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"s": {1, 2}}}}]}],
            "messages[0].tool_calls[0].function.arguments.s",
        ),
        (
            [
                {
                    "role": "assistant",
                    "tool_calls": [{"function": {"name": "f", "arguments": '{"v": "a</｜DSML｜parameter>"}'}}],
                }
            ],
            "messages[0].tool_calls[0].function.arguments.v",
        ),
        (
            [{"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "x</tool_result>y"}],
            "messages[1].content",
        ),
        ([{"role": "tool", "content": {"temp": 3}}], "messages[0].content"),
        ([{"role": "tool", "content": "x", "tool_call_id": 5}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "content": "A", "reasoning_content": ["r"]}], "messages[0].reasoning_content"),
    ],
)
def test_invalid_messages_name_the_index_and_field(messages, where):
    with pytest.raises(ChatEncodingError) as raised:
        encode_messages(messages, "thinking")
    assert raised.value.where == where
    assert str(raised.value).startswith(f"{where}: ")
    assert isinstance(raised.value, ValueError)


def test_invalid_context_message_names_the_context():
    with pytest.raises(ChatEncodingError, match=r"^context\[1\]\.role: "):
        encode_messages([{"role": "user", "content": "x"}], "chat", context=[{"role": "user"}, {"role": "bot"}])


@pytest.mark.parametrize(
    ("arguments", "where"),
    [
        ({"thinking_mode": "reasoning"}, "thinking_mode"),
        ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"),
        ({"profile": "v5"}, "profile"),
    ],
)
def test_invalid_parameters_are_rejected(arguments, where):
    with pytest.raises(ChatEncodingError) as raised:
        encode_messages(QUESTION, **{"thinking_mode": "thinking", **arguments})
    assert raised.value.where == where


def test_tool_result_parts_that_are_not_text_become_placeholders():
    messages = [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "a"}, {"type": "audio"}]},
    ]
    assert "<tool_result>a\n\n[Unsupported audio]</tool_result>" in encode_messages(messages, "chat")


def test_tool_result_without_content_is_empty():
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool"}]
    assert encode_messages(messages, "chat").endswith(
        f"{EOS}<｜User｜><tool_result></tool_result><｜Assistant｜></think>"
    )
