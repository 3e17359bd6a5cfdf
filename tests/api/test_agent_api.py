"""The agent API on one engine process, driven by the official `openai` client with the request shapes of
qualification.md §3 (Pi's defaults included): fields agents send are accepted, the streaming and whole contracts
hold, tool_choice and response_format are enforced by the output grammar (valid even from the tiny random model),
the Responses API's stateless subset works, and /v1/models and /server_info say what is accepted."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from .conftest import CONTEXT_LENGTH

pytestmark = pytest.mark.slow

MODEL = "flash"
FINISH_REASONS = {"stop", "length", "tool_calls", "content_filter"}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
DAYS_PARAMETERS = {
    "type": "object",
    "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["days"],
}
# Pi's shape: `strict` is present and false unless the client turns strict mode on.
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS, "strict": False},
}
FORECAST = {"type": "function", "function": {"name": "forecast", "parameters": DAYS_PARAMETERS, "strict": False}}
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "forecast": DAYS_PARAMETERS}
SYSTEM = {"role": "developer", "content": "You are a coding specialist agent. Follow the harness contract."}
ASK = {"role": "user", "content": "What's the weather in Oakland? Use the tool."}
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "integer"}, "why": {"type": "string", "maxLength": 20}},
    "required": ["answer", "why"],
}
# Seeds on which the tiny model, sampling freely at 0.8 from [SYSTEM, ASK] with WEATHER offered, writes "DSML"
# within 24 tokens: the case tool_choice "none" must keep out.
DSML_SEEDS = (34, 102)
# Pi's defaults for an unknown local URL (qualification.md §3.2).
PI = {"store": False, "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(max_num_seqs=16, max_num_batched_tokens=2048, served_model_name=MODEL)


def chat(server, **kwargs: Any):
    return server.client.chat.completions.create(model=MODEL, **kwargs)


def streamed(server, **kwargs: Any) -> dict[str, Any]:
    """Reassemble a chat stream as Pi and anvil do; check the envelope on the way."""
    chunks = list(chat(server, stream=True, **({"stream_options": {"include_usage": True}} | kwargs)))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(reasons) == 1 and reasons[0] in FINISH_REASONS
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 0
    cached = usage.prompt_tokens_details.cached_tokens  # whole 256-token pages an earlier request computed
    assert 0 <= cached < usage.prompt_tokens and cached % 256 == 0 and usage.completion_tokens_details is not None
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for fragment in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            if fragment.index not in calls:  # the first fragment carries the id and the name
                assert fragment.id and fragment.function.name and fragment.type == "function"
                calls[fragment.index] = {"id": fragment.id, "name": fragment.function.name, "arguments": ""}
            else:
                assert fragment.id in (None, calls[fragment.index]["id"])
            calls[fragment.index]["arguments"] += fragment.function.arguments or ""
    delta = [c.choices[0].delta for c in chunks if c.choices]
    return {
        "content": "".join(d.content or "" for d in delta),
        "reasoning": "".join((d.model_extra or {}).get("reasoning_content") or "" for d in delta),
        "calls": [calls[i] for i in sorted(calls)],
        "finish_reason": reasons[0],
        "usage": usage,
    }


def assert_valid_calls(calls: list[dict[str, str]], names: set[str]) -> None:
    assert calls and len({call["id"] for call in calls}) == len(calls)
    for call in calls:
        assert call["name"] in names
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_models_and_server_info_advertise_what_is_accepted(server):
    (model,) = server.client.models.list().data
    extra = model.model_extra
    capabilities = extra["capabilities"]
    assert server.http.get("/server_info").json()["capabilities"] == capabilities
    assert capabilities["context_length"] == extra["context_length"] == CONTEXT_LENGTH
    assert capabilities["max_output_tokens"] == extra["max_output_tokens"] == CONTEXT_LENGTH - 1
    assert capabilities["tool_choice"] == ["auto", "none", "required", "named"]
    assert capabilities["response_format"] == ["text", "json_object", "json_schema"]
    assert capabilities["strict_tools"] and capabilities["developer_role"] and capabilities["usage_in_streaming"]
    assert capabilities["thinking"] and not capabilities["thinking_default"]
    assert capabilities["reasoning_efforts"] == ["low", "high", "max"]
    assert "/v1/responses" in capabilities["endpoints"] and not capabilities["stateful_responses"]


def test_pi_streaming_tool_call_meets_the_contract(server):
    with server.http.stream(
        "POST",
        "/v1/chat/completions",
        json={"model": MODEL, "messages": [SYSTEM, ASK], "tools": [WEATHER], "tool_choice": "required",
              "stream": True, "max_completion_tokens": 64, "temperature": 0.8, **PI},
    ) as response:  # fmt: skip
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    fragments = [t for e in events if e["choices"] for t in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [(f["index"], f["function"]["name"]) for f in fragments] == [(0, "get_weather")]
    assert fragments[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(fragments[0]["function"]["arguments"]), WEATHER_PARAMETERS)
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "tool_calls"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] <= 64


def test_pi_auto_request_streams_text_or_calls_without_markup(server):
    got = streamed(
        server, messages=[SYSTEM, ASK], tools=[WEATHER], max_completion_tokens=24, temperature=0.8, seed=3, **PI
    )
    assert "DSML" not in got["content"] and got["finish_reason"] in ("stop", "length", "tool_calls")
    assert bool(got["calls"]) == (got["finish_reason"] == "tool_calls")


def test_fields_agents_send_are_accepted_and_never_rejected(server):
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    for extra in (
        {"tools": [], "tool_choice": "auto"},
        {"tools": [strict], "parallel_tool_calls": False, "tool_choice": "none"},
        {"max_tokens": 3, "max_completion_tokens": 2, "stream_options": {"include_usage": True}},
    ):
        response = chat(
            server,
            messages=[SYSTEM, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
            store=False,
            metadata={"session": "x"},
            user="agent-7",
            temperature=0,
            **({"max_completion_tokens": 2} | extra),
        )
        assert response.choices[0].finish_reason in ("stop", "length") and response.usage.completion_tokens <= 2


def _history(reasoning_field: str | None) -> list[dict[str, Any]]:
    """A turn that called a tool, echoed back as Pi echoes it: content as text parts, reasoning under the field it
    streamed in, arguments as a JSON string, then the tool's result."""
    assistant: dict[str, Any] = {
        "role": "assistant",
        "content": [{"type": "text", "text": "Checking."}],
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Oakland"}'},
            }
        ],
    }
    if reasoning_field:
        assistant[reasoning_field] = "The user wants the weather, so I call the tool."
    result = {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature_f": 72}'}
    return [SYSTEM, ASK, assistant, result, {"role": "user", "content": "Reply exactly OAKLAND 72F."}]


def test_history_with_echoed_reasoning_text_parts_and_tool_results(server):
    fields = (None, "reasoning_content", "reasoning", "reasoning_text")
    with ThreadPoolExecutor(len(fields)) as pool:
        usages = pool.map(
            lambda field: (
                chat(
                    server,
                    messages=_history(field),
                    tools=[WEATHER],
                    reasoning_effort="low",
                    max_completion_tokens=1,
                    **PI,
                ).usage
            ),
            fields,
        )
    prompt_tokens = {field: usage.prompt_tokens for field, usage in zip(fields, usages, strict=True)}
    # With tools declared the history keeps its reasoning, whichever field it came back in.
    assert prompt_tokens["reasoning_content"] == prompt_tokens["reasoning"] == prompt_tokens["reasoning_text"]
    assert prompt_tokens["reasoning_content"] > prompt_tokens[None]
    # The second turn of the tool-result gate: no tools offered this turn (Pi sends an empty array).
    second = chat(server, messages=_history("reasoning_content"), tools=[], max_completion_tokens=4, **PI)
    assert second.choices[0].finish_reason in ("stop", "length")


def test_developer_is_a_system_message_that_thinking_never_drops(server):
    def prompt_tokens(role: str) -> int:
        messages = [
            {"role": role, "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Bye"},
        ]
        return chat(server, messages=messages, reasoning_effort="high", max_tokens=1).usage.prompt_tokens

    assert prompt_tokens("developer") == prompt_tokens("system")


def test_thinking_is_off_unless_asked_and_efforts_are_distinct(server):
    def run(**kwargs: Any):
        return chat(server, messages=[ASK], max_tokens=2, temperature=0, **kwargs)

    plain = run()
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    assert plain.usage.completion_tokens_details.reasoning_tokens == 0
    tokens = {effort: run(reasoning_effort=effort).usage.prompt_tokens for effort in ("minimal", "low", "high", "max")}
    # Pi's levels map onto DeepSeek-V4's three (qualification.md §2.2, the reasoning-effort fingerprint).
    assert tokens["minimal"] == tokens["low"] < tokens["high"] < tokens["max"]
    assert run(reasoning_effort="xhigh").usage.prompt_tokens == tokens["max"]
    kwargs_on = run(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert (
        kwargs_on.usage.prompt_tokens == tokens["low"] and kwargs_on.choices[0].message.model_extra["reasoning_content"]
    )
    assert run(reasoning_effort="none").usage.prompt_tokens == plain.usage.prompt_tokens


def test_thinking_then_a_required_call(server):
    got = streamed(
        server, messages=[SYSTEM, ASK], tools=[WEATHER, FORECAST], tool_choice="required", reasoning_effort="high",
        max_completion_tokens=96, temperature=0.8, **PI,
    )  # fmt: skip
    assert got["reasoning"] and not got["content"] and got["finish_reason"] == "tool_calls"
    assert got["usage"].completion_tokens_details.reasoning_tokens > 0
    assert_valid_calls(got["calls"], {"get_weather", "forecast"})


def test_tool_choice_none_gives_no_calls_and_no_markup(server):
    request = {"messages": [SYSTEM, ASK], "tools": [WEATHER], "max_tokens": 24, "temperature": 0.8, "logprobs": True}
    for seed in DSML_SEEDS:
        free = chat(server, seed=seed, **request)  # `auto` with a tool that is not strict: no grammar
        assert "DSML" in "".join(entry.token for entry in free.choices[0].logprobs.content), seed
        choice = chat(server, seed=seed, tool_choice="none", **request).choices[0]
        # The grammar, not the parser, keeps it out: no sampled token spells it either.
        assert "DSML" not in "".join(entry.token for entry in choice.logprobs.content), seed
        assert not choice.message.tool_calls and "DSML" not in choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_strict_tools_under_auto(server):
    strict = {**WEATHER, "function": {**WEATHER["function"], "strict": True}}
    with ThreadPoolExecutor(3) as pool:
        responses = list(
            pool.map(
                lambda seed: chat(
                    server, messages=[SYSTEM, ASK], tools=[strict], max_tokens=64, temperature=0.8, seed=seed
                ),
                range(3),
            )
        )
    for response in responses:
        choice = response.choices[0]
        assert "DSML" not in (choice.message.content or "")
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        if calls:
            assert_valid_calls(calls, {"get_weather"})
        assert choice.finish_reason == ("tool_calls" if calls else "stop")  # the grammar ends it within the budget


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
    ],
    ids=["json_object", "json_schema"],
)
def test_json_output_validates(server, response_format):
    schema = response_format.get("json_schema", {}).get("schema", {"type": "object"})
    for seed, stream in ((1, False), (2, True)):
        kwargs = {"messages": [ASK], "response_format": response_format, "max_tokens": 48, "temperature": 0.8,
                  "seed": seed}  # fmt: skip
        content = streamed(server, **kwargs)["content"] if stream else chat(server, **kwargs).choices[0].message.content
        jsonschema.validate(json.loads(content), schema)


def test_a_hundred_required_or_named_calls_in_a_row_are_schema_valid(server):
    named = {"type": "function", "function": {"name": "forecast"}}

    def one(i: int) -> dict[str, Any]:
        kwargs = {"messages": [ASK], "tools": [WEATHER, FORECAST], "tool_choice": named if i % 2 else "required",
                  "max_tokens": 64, "temperature": 0.8}  # fmt: skip
        if i % 4 == 3:
            got = streamed(server, **kwargs)
            return {"calls": got["calls"], "finish_reason": got["finish_reason"], "named": True}
        choice = chat(server, **kwargs).choices[0]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in choice.message.tool_calls
        ]
        assert choice.message.content is None
        return {"calls": calls, "finish_reason": choice.finish_reason, "named": bool(i % 2)}

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(100)))
    for result in results:
        assert result["finish_reason"] == "tool_calls"
        assert_valid_calls(result["calls"], {"forecast"} if result["named"] else {"get_weather", "forecast"})


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strin"}}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
            "a": {"$ref": "#/missing"}}, "required": ["a"]}}}], "tool_choice": "required"}, "tools"),
    ],
    ids=["unknown-named-tool", "required-without-tools", "unknown-format", "bad-schema", "bad-tool-schema"],
)  # fmt: skip
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    response = server.http.post("/v1/chat/completions", json={"model": MODEL, "messages": [ASK], **body})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_responses_string_input(server):
    response = server.client.responses.create(
        model=MODEL, input="Reply with exactly READY", instructions="Be terse.", max_output_tokens=8, temperature=0
    )
    assert response.object == "response" and response.status in ("completed", "incomplete")
    assert response.output[-1].type == "message" and isinstance(response.output_text, str)
    assert response.instructions == "Be terse." and response.max_output_tokens == 8
    usage = response.usage
    assert usage.output_tokens <= 8 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"


def test_responses_items_render_like_the_chat_history(server):
    items = [
        {"type": "message", "role": "developer", "content": SYSTEM["content"]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": ASK["content"]}]},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "The user wants the weather, so I call the tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oakland"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature_f": 72}'},
        {"type": "message", "role": "user", "content": "Reply exactly OAKLAND 72F."},
    ]  # fmt: skip
    flat = {"type": "function", "name": "get_weather", "description": "Weather", "parameters": WEATHER_PARAMETERS,
            "strict": False}  # fmt: skip
    response = server.client.responses.create(
        model=MODEL, input=items, tools=[flat], reasoning={"effort": "low"}, max_output_tokens=1, store=False
    )
    expected = chat(
        server, messages=_history("reasoning_content"), tools=[WEATHER], reasoning_effort="low", max_tokens=1
    )
    assert response.usage.input_tokens == expected.usage.prompt_tokens


def test_responses_stream_with_a_required_call_and_reasoning(server):
    # The tiny model sampling at 0.8 may close its reasoning at once (then no reasoning item is right), so a few
    # seeds are tried: every stream must be well formed, and one of them must carry reasoning.
    flat = {"type": "function", "name": "forecast", "parameters": DAYS_PARAMETERS}
    reasoned = []
    for seed in range(6):
        events = list(
            server.client.responses.create(
                model=MODEL, input=[{"role": "user", "content": "Forecast?"}], tools=[flat], tool_choice="required",
                reasoning={"effort": "high"}, max_output_tokens=64, temperature=0.8, stream=True,
                extra_body={"seed": seed},
            )
        )  # fmt: skip
        kinds = [event.type for event in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.function_call_arguments.done" in kinds
        final = events[-1].response
        call = final.output[-1]
        assert call.type == "function_call" and call.name == "forecast" and call.call_id.startswith("call_")
        jsonschema.validate(json.loads(call.arguments), DAYS_PARAMETERS)
        if "response.reasoning_summary_text.delta" in kinds:
            assert [item.type for item in final.output] == ["reasoning", "function_call"]
            assert final.output[0].summary[0].text and final.usage.output_tokens_details.reasoning_tokens > 0
            reasoned.append(seed)
        else:
            assert [item.type for item in final.output] == ["function_call"]
        if len(reasoned) == 2:
            break
    assert reasoned, "no seed gave reasoning"


def test_responses_json_schema_format(server):
    response = server.client.responses.create(
        model=MODEL, input="An answer?", max_output_tokens=48, temperature=0.8,
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(response.output_text), ANSWER_SCHEMA)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ],
)
def test_responses_refuses_state_it_does_not_keep(server, body, param):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client.responses.create(model=MODEL, **({"input": "Hi"} | body))
    error = raised.value.body
    assert error["param"] == param and error["message"]
    if param == "previous_response_id":
        assert "keeps no responses" in error["message"]


def test_nothing_was_logged_as_an_error(server):
    errors = [e for e in server.logs() if e["level"] in ("error", "critical")]
    assert not errors, errors


def test_an_agents_next_turn_reports_the_prompt_tokens_it_reused(server):
    """Pi's next turn re-sends the conversation: chat, completions and the Responses API report the whole pages taken
    from the prefix cache in their usage, and /metrics counts them as hits among the prompt tokens looked up."""
    history = [{"role": "system", "content": "You are a coding agent. " + "Read the files. " * 60},
               {"role": "user", "content": "Summarise the repository layout in one line."}]  # fmt: skip
    before = server.metrics()
    first = chat(server, messages=history, max_tokens=8)
    history += [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                {"role": "user", "content": "And the tests?"}]  # fmt: skip
    second = chat(server, messages=history, max_tokens=8)
    reused = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens > 512 and reused >= 512 and reused % 256 == 0
    ids = list(range(5, 5 + 600))
    plain = [server.client.completions.create(model=MODEL, prompt=ids + [7, 8], max_tokens=2) for _ in range(2)]
    assert plain[1].usage.prompt_tokens_details.cached_tokens == 512
    response = server.http.post("/v1/responses", json={"model": MODEL, "input": history[1:], "instructions":
                                history[0]["content"], "max_output_tokens": 4}).json()  # fmt: skip
    assert response["usage"]["input_tokens_details"]["cached_tokens"] >= 512
    after = server.metrics()
    hits = after["flashgate_prefix_cache_hits_tokens_total"] - before["flashgate_prefix_cache_hits_tokens_total"]
    queried = (
        after["flashgate_prefix_cache_queries_tokens_total"] - before["flashgate_prefix_cache_queries_tokens_total"]
    )
    assert hits >= reused + 512 and queried >= first.usage.prompt_tokens + second.usage.prompt_tokens
