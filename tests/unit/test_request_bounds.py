"""What one request may cost the engine is bounded before the costly part, and every refusal is a 400 naming the
field (engine/server/protocol.py): the body's JSON (depth, NaN/Infinity, lone surrogates), the prompt's bytes before
it is tokenized, stop strings, seeds and temperatures; and sampling at any accepted temperature is finite."""

from __future__ import annotations

import json

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.server.protocol import (
    MAX_JSON_DEPTH,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    ApiError,
    Limits,
    body_bytes_limit,
    parse_body,
    parse_chat,
    parse_completion,
    prompt_bytes_limit,
)
from engine.tokenizer import Tokenizer
from engine.tools.tiny_tokenizer import build_tiny_tokenizer

LIMITS = Limits(served_model_name="tiny", context_length=64, kv_capacity_tokens=4096, vocab_size=1024)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tiny_tokenizer())


def refusal(call, *args) -> ApiError:
    with pytest.raises(ApiError) as caught:
        call(*args)
    assert caught.value.status == 400, caught.value.message
    return caught.value


def nested(depth: int) -> bytes:
    return b'{"a": ' * (depth - 1) + b"{}" + b"}" * (depth - 1)


def test_json_nests_at_most_max_depth_levels():
    assert parse_body(nested(MAX_JSON_DEPTH))
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        error = refusal(parse_body, nested(depth))
        assert error.code == "invalid_json" and f"{MAX_JSON_DEPTH} levels" in error.message
    assert refusal(parse_body, b"[" * 100_000 + b"]" * 100_000).code == "invalid_json"


@pytest.mark.parametrize(
    ("raw", "param"),
    [
        (b'{"temperature": NaN}', "temperature"),
        (b'{"top_p": Infinity}', "top_p"),
        (b'{"max_tokens": -Infinity}', "max_tokens"),
        (b'{"temperature": 1e999}', "temperature"),
        (b'{"tools": [{"function": {"parameters": {"minimum": NaN}}}]}', "tools[0].function.parameters.minimum"),
        (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages[0].content"),
        (b'{"tools": [{"function": {"name": "\\udfff"}}]}', "tools[0].function.name"),
        (b'{"stop": ["ok", "\\ud83d"]}', "stop[1]"),
    ],
)
def test_values_no_engine_part_can_take_are_refused_by_their_path(raw, param):
    assert refusal(parse_body, raw).param == param


def test_a_paired_surrogate_escape_is_one_character_and_passes():
    assert parse_body(b'{"content": "\\ud83d\\ude00"}') == {"content": "\U0001f600"}


def test_bodies_that_are_not_json_objects():
    assert refusal(parse_body, b"\xff\xfe not utf-8").code == "invalid_json"
    assert refusal(parse_body, b"[1, 2]").code == "invalid_request_body"


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(tokenizer, monkeypatch):
    limit = prompt_bytes_limit(LIMITS, tokenizer)
    assert limit == LIMITS.context_length * tokenizer.max_token_bytes
    assert body_bytes_limit(LIMITS, tokenizer) > 6 * limit

    def never(*args, **kwargs):
        raise AssertionError("tokenized")

    monkeypatch.setattr(tokenizer, "encode", never)
    huge = "x" * (limit + 1)
    error = refusal(parse_completion, {"prompt": huge}, tokenizer, LIMITS)
    assert (error.param, error.code) == ("prompt", "context_length_exceeded") and str(limit) in error.message
    error = refusal(parse_chat, {"messages": [{"role": "user", "content": huge}]}, tokenizer, LIMITS, None)
    assert (error.param, error.code) == ("messages", "context_length_exceeded")


def test_no_text_over_the_byte_limit_fits_the_context(tokenizer):
    """The byte limit is a bound: the text with the most bytes a token, repeated to the limit, still overflows."""
    longest = max(tokenizer._tok.get_vocab(with_added_tokens=True), key=lambda piece: len(piece.encode()))
    text = tokenizer.decode([tokenizer.token_id(longest)], skip_special_tokens=False)
    assert len(tokenizer.encode(text * LIMITS.context_length)) >= LIMITS.context_length


@pytest.mark.parametrize(
    ("stop", "limit"),
    [
        (["s"] * (MAX_STOP_STRINGS + 1), str(MAX_STOP_STRINGS)),
        (["x" * (MAX_STOP_STRING_CHARS + 1)], str(MAX_STOP_STRING_CHARS)),
        ([f"{i:04}" * 2500 for i in range(1000)], str(MAX_STOP_STRINGS)),
    ],
)
def test_stop_strings_are_bounded_in_count_and_length(tokenizer, stop, limit):
    error = refusal(parse_completion, {"prompt": "hi", "stop": stop}, tokenizer, LIMITS)
    assert error.param == "stop" and limit in error.message


def test_the_bounds_themselves_are_accepted(tokenizer):
    stop = ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS
    assert parse_completion({"prompt": "hi", "stop": stop}, tokenizer, LIMITS).params.stop == stop
    for seed in (-(2**63), 2**64 - 1):
        assert parse_completion({"prompt": "hi", "seed": seed}, tokenizer, LIMITS).params.seed == seed


@pytest.mark.parametrize(
    ("field", "value"),
    [("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", 10**400), ("top_p", 10**400), ("temperature", -1e-9)],
)
def test_numbers_out_of_range_name_their_field(tokenizer, field, value):
    error = refusal(parse_completion, {"prompt": "hi", field: value}, tokenizer, LIMITS)
    assert error.param == field and "Overflow" not in error.message


@pytest.mark.parametrize("temperature", [1e-39, 5e-324, 1e-6])
def test_tiny_temperatures_are_greedy(temperature):
    params = SamplingParams(temperature=temperature)
    assert params.greedy
    logits = torch.randn(1024, generator=torch.Generator().manual_seed(0)) * 30
    assert sample(logits, params, None, 1)[0] == int(torch.argmax(logits))


@pytest.mark.parametrize("temperature", [1e-5, 1e-3, 1.0, 1e30, 1.7e308])
def test_sampling_is_finite_at_every_accepted_temperature(temperature):
    logits = torch.randn(1024, generator=torch.Generator().manual_seed(1)) * 1e3
    params = SamplingParams(temperature=temperature, top_p=0.5, top_k=10, seed=3)
    token, _ = sample(logits, params, torch.Generator().manual_seed(3), 1)
    assert 0 <= token < 1024


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"type": "object", "properties": ["a"]}, "tools[0].function.parameters.properties"),
        ({"type": "object", "properties": {"a": 3}}, "tools[0].function.parameters.properties"),
        ({"type": "object", "properties": {}, "required": "a"}, "tools[0].function.parameters.required"),
        ("not a schema", "tools[0].function.parameters"),
    ],
)
def test_tool_schemas_the_grammar_cannot_read_are_refused(tokenizer, parameters, param):
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": parameters}}],
    }
    assert refusal(parse_chat, json.loads(json.dumps(body)), tokenizer, LIMITS, None).param == param


def test_the_route_names_the_engines_depth_limit():
    """The console cannot import the engine: its route keeps its own copy of the limit it names."""
    from app.route.proxy import MAX_JSON_DEPTH as ROUTE_DEPTH

    assert ROUTE_DEPTH == MAX_JSON_DEPTH
