"""Output grammars without a server (engine/server/grammar.py, tool_calls.py): xgrammar's view of the tiny byte-level
tokenizer, formats that accept exactly what the encoder writes and the parser reads, and the forced ending: a random
model (random logits, temperature 0.8) always ends its constrained output validly within its token budget."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr
from xgrammar.structural_tag import StructuralTag

from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.server import dsml
from engine.server.chat_encoding import DSML, EOS, THINK_END, encode_messages
from engine.server.grammar import GrammarConstraint, GrammarError, Grammars, output_format
from engine.server.tool_calls import ToolsError, parse_tool_policy
from engine.tokenizer import Tokenizer
from engine.tools.tiny_tokenizer import DSV4_TOKENS, build_tiny_tokenizer

# The tiny model's logits are wider than its tokenizer: ids past the tokenizer's are padding, never allowed.
VOCAB = 1056
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
        },
        "strict": True,
    },
}
EDIT = {
    "type": "function",
    "function": {
        "name": "edit",
        "parameters": {
            "type": "object",
            "$defs": {"Range": {"type": "object", "properties": {"start": {"type": "integer", "minimum": 1}}}},
            "properties": {
                "path": {"type": "string", "minLength": 2, "maxLength": 12},
                "range": {"$ref": "#/$defs/Range"},
                "lines": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3},
                "force": {"type": "boolean"},
                "mode": {"type": "string", "pattern": "^[a-z]{2,4}$"},
                "ratio": {"type": ["number", "null"]},
            },
            "required": ["path", "lines", "mode"],
        },
    },
}
NOOP = {"type": "function", "function": {"name": "noop"}}
TOOLS = {tool["function"]["name"]: tool for tool in (WEATHER, EDIT, NOOP)}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["answer", "tags"],
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer())


@pytest.fixture(scope="module")
def grammars(tokenizer) -> Grammars:
    return Grammars(tokenizer, VOCAB)


def constraint(grammars: Grammars, body: Mapping[str, Any], thinking: bool = False, schema: Any = None):
    fmt = output_format(parse_tool_policy(body), schema)
    assert fmt is not None
    return grammars.constraint(fmt, thinking)


def random_model(
    grammars: Grammars, given: GrammarConstraint, max_tokens: int, seed: int, temperature: float = 0.8
) -> list[int]:
    """Decode like the engine does, from random logits: stop at EOS or at max_tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        logits = torch.randn(VOCAB, generator=generator) * 3
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, constraint=given)
        token, _ = sample(logits, params, generator, max_tokens - len(tokens))
        tokens.append(token)
        if token == grammars.eos_id:
            break
    return tokens


def text_of(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=False)


def test_token_bytes_spell_every_text(tokenizer):
    pieces = tokenizer.token_bytes()
    assert len(pieces) == tokenizer.vocab_size
    for token, special in DSV4_TOKENS:
        assert (pieces[tokenizer.token_id(token)] is None) == special
    assert pieces[tokenizer.token_id(DSML)] == DSML.encode()
    for text in ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">', "天气 ☀️ é</think>", "\x00\x7f  tabs\t"):
        assert b"".join(pieces[i] for i in tokenizer.encode(text)) == text.encode()


def test_control_and_padding_tokens_are_never_allowed(grammars, tokenizer):
    matcher = xgr.GrammarMatcher(
        grammars.compiler.compile_structural_tag(
            StructuralTag(format=output_format(parse_tool_policy({"tools": [WEATHER], "tool_choice": "none"}), None))
        )
    )
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = grammars.allowed(bitmask)
    control = [tokenizer.token_id(token) for token, special in DSV4_TOKENS if special and token != EOS]
    assert not allowed[control].any() and not allowed[tokenizer.vocab_size :].any()
    assert allowed[grammars.eos_id] and allowed[tokenizer.encode(" the")].all()
    # Free text under tool_choice "none" may not hold DSML markup (nor think tags).
    assert not allowed[tokenizer.token_id(DSML)] and not allowed[tokenizer.token_id(THINK_END)]


def _encoded_block(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """The tool-call block the encoder writes for these calls in history."""
    message = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}
            for i, (name, arguments) in enumerate(calls)
        ],
    }
    prompt = encode_messages([{"role": "user", "content": "x"}, message], "chat")
    return prompt[prompt.index("\n\n<｜DSML｜") : prompt.index(EOS, prompt.index("\n\n<｜DSML｜"))]


@pytest.mark.parametrize(
    "calls",
    [
        [("get_weather", {"city": "Oakland"})],
        [("get_weather", {"city": 'São Paulo <b> "quoted"\nline', "unit": "celsius"})],
        [("noop", {})],
        [("edit", {"path": "a.py", "range": {"start": 3}, "lines": ["x", "y"], "mode": "ab", "ratio": None})],
        [("get_weather", {"city": "A"}), ("noop", {}), ("edit", {"path": "ab", "lines": [""], "mode": "zz"})],
    ],
    ids=["string", "raw-text-and-enum", "no-parameters", "json-values", "parallel"],
)
def test_the_block_grammar_accepts_what_the_encoder_writes_and_the_parser_reads(grammars, calls):
    block = _encoded_block(calls)
    given = constraint(grammars, {"tools": list(TOOLS.values()), "tool_choice": "required"})
    assert given.matcher.accept_string(block) and given.matcher.is_completed()
    parsed = dsml.parse_output(block + EOS, tools_offered=True, thinking=False)
    assert [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls] == calls


@pytest.mark.parametrize(
    "text",
    [
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="town" string="true">x</｜DSML｜parameter>',
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>',
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">a｜DSML｜b',
        '<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="false">3',
        '<｜DSML｜invoke name="get_weather">\n\n<｜DSML｜parameter name="city"',
        '<｜DSML｜invoke name="edit">\n<｜DSML｜parameter name="path" string="false">"a\x01b"',
        '<｜DSML｜invoke name="other">',
    ],
    ids=[
        "unknown-parameter",
        "missing-required",
        "markup-in-value",
        "wrong-type",
        "extra-newline",
        "control-char",
        "unknown-tool",
    ],  # fmt: skip
)
def test_the_block_grammar_refuses_what_would_not_parse_or_validate(grammars, text):
    given = constraint(grammars, {"tools": [WEATHER, EDIT], "tool_choice": "required"})
    assert not given.matcher.accept_string("\n\n<｜DSML｜tool_calls>\n" + text)


def test_parallel_tool_calls_false_allows_one_call(grammars):
    given = constraint(grammars, {"tools": [NOOP], "tool_choice": "required", "parallel_tool_calls": False})
    one = _encoded_block([("noop", {})])
    assert given.matcher.accept_string(one[: -len("\n</｜DSML｜tool_calls>")])
    assert not given.matcher.accept_string('\n<｜DSML｜invoke name="noop">')


def test_the_ending_from_the_start_is_the_shortest_call(grammars, tokenizer):
    given = constraint(grammars, {"tools": [WEATHER], "tool_choice": "required"})
    assert given.ending[-1] == grammars.eos_id
    assert text_of(tokenizer, given.ending[:-1]) == _encoded_block([("get_weather", {"city": ""})])


@pytest.mark.parametrize(
    ("body", "thinking", "max_tokens"),
    [
        ({"tools": [WEATHER], "tool_choice": "required"}, False, 64),
        (
            {"tools": [WEATHER, NOOP], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
            False,
            64,
        ),
        ({"tools": list(TOOLS.values()), "tool_choice": "required"}, False, 160),
        ({"tools": [EDIT], "tool_choice": "required"}, True, 160),
        ({"tools": [WEATHER], "tool_choice": "required"}, True, 56),
    ],
    ids=["required", "named", "three-tools", "schema-features-thinking", "thinking-tight-budget"],
)
def test_random_model_calls_are_valid_within_max_tokens(grammars, tokenizer, body, thinking, max_tokens):
    names = {body["tool_choice"]["function"]["name"]} if isinstance(body["tool_choice"], dict) else set(TOOLS)
    for seed in range(12):
        tokens = random_model(grammars, constraint(grammars, body, thinking), max_tokens, seed)
        assert len(tokens) <= max_tokens and tokens[-1] == grammars.eos_id
        parsed = dsml.parse_output(text_of(tokenizer, tokens), tools_offered=True, thinking=thinking)
        assert parsed.tool_calls and not parsed.malformed and not parsed.content, parsed
        for call in parsed.tool_calls:
            assert call.name in names
            jsonschema.validate(json.loads(call.arguments), TOOLS[call.name]["function"].get("parameters", {}))


def test_thinking_is_closed_in_time(grammars, tokenizer):
    for seed in range(6):
        given = constraint(grammars, {"tools": [WEATHER], "tool_choice": "required"}, thinking=True)
        max_tokens = len(grammars.think_end) + len(given.ending) + 5  # five tokens to reason with
        tokens = random_model(grammars, given, max_tokens, seed)
        parsed = dsml.parse_output(text_of(tokenizer, tokens), tools_offered=True, thinking=True)
        assert len(tokens) <= max_tokens and parsed.reasoning and parsed.tool_calls and not parsed.malformed


def test_reasoning_before_a_required_call_cannot_end_or_hold_markup(grammars, tokenizer):
    given = constraint(grammars, {"tools": [WEATHER], "tool_choice": "required"}, thinking=True)
    logits = torch.zeros(VOCAB)
    logits[[grammars.eos_id, tokenizer.token_id(DSML)]] = 100.0
    token, _ = sample(logits, SamplingParams(temperature=0, constraint=given), None, 1000)
    assert token not in (grammars.eos_id, tokenizer.token_id(DSML))


@pytest.mark.parametrize(
    ("schema", "max_tokens"), [({"type": "object"}, 48), (ANSWER, 64), ({"type": "string", "maxLength": 5}, 16)]
)
def test_random_model_json_content_validates(grammars, tokenizer, schema, max_tokens):
    for seed in range(10):
        given = constraint(grammars, {}, schema=schema)
        tokens = random_model(grammars, given, max_tokens, seed)
        assert len(tokens) <= max_tokens and tokens[-1] == grammars.eos_id
        jsonschema.validate(json.loads(text_of(tokenizer, tokens[:-1])), schema)


def test_strict_tools_under_auto_allow_text_then_a_valid_call(grammars, tokenizer):
    block = _encoded_block([("get_weather", {"city": "Oakland"})])
    assert constraint(grammars, {"tools": [WEATHER]}).matcher.accept_string("Let me look.")
    assert constraint(grammars, {"tools": [WEATHER]}).matcher.accept_string("Let me look." + block)
    assert not constraint(grammars, {"tools": [WEATHER]}).matcher.accept_string('Hi <｜DSML｜invoke name="x">')
    for seed in range(10):
        tokens = random_model(grammars, constraint(grammars, {"tools": [WEATHER]}), 64, seed)
        parsed = dsml.parse_output(text_of(tokenizer, tokens), tools_offered=True, thinking=False)
        assert tokens[-1] == grammars.eos_id and not parsed.malformed and DSML not in parsed.content
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])


def test_a_budget_below_the_shortest_ending_is_cut(grammars, tokenizer):
    given = constraint(grammars, {"tools": [WEATHER], "tool_choice": "required"})
    ending = list(given.ending)
    tokens = random_model(grammars, given, 10, seed=0)
    assert tokens == ending[:10]
    assert not dsml.parse_output(text_of(tokenizer, tokens), tools_offered=True, thinking=False).tool_calls


def test_the_sampler_asks_the_constraint_and_reports_the_model_logprobs(grammars):
    given = constraint(grammars, {"tools": [WEATHER], "tool_choice": "required"})
    logits = torch.zeros(VOCAB)
    logits[5] = 10.0  # "<think>", which the grammar does not allow here
    token, logprob = sample(logits, SamplingParams(temperature=0, logprobs=1, constraint=given), None, 64)
    assert "\n\n<｜DSML｜tool_calls>".startswith(grammars.tokenizer.decode([token], skip_special_tokens=False))
    assert list(logprob.top) == [5]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"type": "object", "properties": {"a": {"$ref": "#/nope"}}, "required": ["a"]}, "nope"),
        ({"type": "object", "properties": {"a": {"type": "strin"}}}, "strin"),
        ({"type": "object", "properties": {'say "hi"': {"type": "string"}}}, "DSML call"),
    ],
)
def test_schemas_that_cannot_be_constrained_say_why(grammars, parameters, message):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    with pytest.raises((GrammarError, ToolsError), match=message):
        constraint(grammars, {"tools": [tool], "tool_choice": "required"})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": {}}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_tool_policy_errors_name_the_field(body, param):
    with pytest.raises(ToolsError) as raised:
        parse_tool_policy(body)
    assert raised.value.param == param


def test_what_is_left_unconstrained(grammars):
    assert output_format(parse_tool_policy({}), None) is None
    assert output_format(parse_tool_policy({"tools": []}), None) is None
    unstrict = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}
    assert output_format(parse_tool_policy({"tools": [unstrict]}), None) is None
    assert output_format(parse_tool_policy({"tools": [unstrict], "tool_choice": "none"}), None) is not None
