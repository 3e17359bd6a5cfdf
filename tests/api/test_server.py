"""The OpenAI-compatible surface and the console contract, on one engine process: ready line, /server_info,
/v1/models, chat and completions (stream and whole) against the offline greedy oracle, concurrency, limits,
malformed requests, client disconnects and /metrics."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import torch

from engine import EngineConfig, SamplingParams
from engine.server.chat_encoding import encode_messages

from .conftest import CONTEXT_LENGTH, READY

pytestmark = pytest.mark.slow

SERVER_INFO_KEYS = {
    "model",
    "served_model_name",
    "build",
    "config",
    "kv_capacity_tokens",
    "kv_pages",
    "kv_bytes_per_token",
    "per_sequence_state_bytes",
    "gpu_memory",
    "gpu_memory_per_rank",
    "max_concurrency_at_full_context",
    "prefix_cache",
}
CONTRACT_METRICS = (
    "flashgate_kv_capacity_tokens",
    "flashgate_kv_used_tokens",
    "flashgate_requests_running",
    "flashgate_requests_waiting",
    "flashgate_prompt_tokens_total",
    "flashgate_generation_tokens_total",
    "flashgate_preemptions_total",
    "flashgate_time_to_first_token_seconds_count",
    "flashgate_time_per_output_token_seconds_count",
)
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name the engine's parts."}]
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def server(start_server):
    # A step budget of 64 tokens makes every prompt here over 64 tokens prefill in chunks.
    return start_server(max_num_seqs=4, max_num_batched_tokens=64, served_model_name="flash")


def prompts(*lengths: int, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in lengths]


def test_ready_line_server_info_and_boot_stages_agree(server):
    ready = READY.match(server.ready_line)
    assert ready, server.ready_line
    info = server.http.get("/server_info").json()
    # DESIGN.md's keys exactly, plus what the API accepts (test_agent_api.py checks it).
    assert set(info) == SERVER_INFO_KEYS | {"capabilities"}
    config = info["config"]
    assert list(config) == EngineConfig.field_names()
    assert int(ready["context_len"]) == config["context_length"] == CONTEXT_LENGTH
    assert int(ready["max_total_num_tokens"]) == info["kv_capacity_tokens"] == info["kv_pages"] * config["page_size"]
    assert int(ready["max_num_seqs"]) == config["max_num_seqs"] == 4
    assert int(ready["max_num_batched_tokens"]) == config["max_num_batched_tokens"] == 64
    assert float(ready["available_gpu_mem"]) == 0.0 and info["gpu_memory"]["free_bytes"] is None
    assert set(info["gpu_memory"]) == {"total_bytes", "free_bytes", "weights_bytes", "kv_bytes", "graph_bytes"}
    assert info["gpu_memory"]["weights_bytes"] > 0 and info["gpu_memory"]["total_bytes"] is None
    # The CPU default pool holds max_num_seqs requests at full context; everything "auto" is resolved.
    assert info["max_concurrency_at_full_context"] == 4.0
    assert (config["device"], config["dtype"], config["kv_cache_dtype"]) == ("cpu", "float32", "float32")
    assert info["served_model_name"] == config["served_model_name"] == "flash" and info["build"] == "test-build"
    assert info["kv_bytes_per_token"] > 0 and info["per_sequence_state_bytes"] > 0
    stages = [(e["stage"], e.get("skipped")) for e in server.logs() if e["event"] == "boot_stage"]
    assert stages == [("weights", None), ("kv_alloc", None), ("graph_capture", "cpu"), ("ready", None)]
    assert any(e["event"] == "load_progress" for e in server.logs())
    assert server.http.get("/health").status_code == 200


def test_models_lists_the_served_id_with_its_limits(server):
    (model,) = server.client.models.list().data
    assert model.id == "flash"
    extra = model.model_extra
    assert extra["max_model_len"] == CONTEXT_LENGTH and extra["max_output_tokens"] == CONTEXT_LENGTH - 1
    assert extra["capabilities"]["tools"] and extra["capabilities"]["reasoning_efforts"] == ["low", "high", "max"]


def test_chat_stream_and_whole_equal_the_offline_greedy_decode(server, oracle):
    whole = server.client.chat.completions.create(model="flash", messages=MESSAGES, max_tokens=24, **GREEDY)
    stream = server.client.chat.completions.create(
        model="flash", messages=MESSAGES, max_tokens=24, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    prompt_ids = oracle.engine.tokenizer.encode(encode_messages(MESSAGES, "chat"))
    expected = oracle.generate(prompt_ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert whole.choices[0].message.content == streamed == expected.text
    assert whole.choices[0].finish_reason == "length" and finish == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == len(prompt_ids) == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens == 24
    assert usage.completion_tokens_details.reasoning_tokens == 0


def test_the_raw_stream_ends_in_done(server):
    body = {"messages": MESSAGES, "max_tokens": 3, "stream": True}
    with server.http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] == "length"


def test_completions_from_text_and_token_ids_stream_and_whole(server, oracle):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    (ids,) = prompts(150)
    for prompt in ("The engine reads a prompt", ids):
        expected = oracle.generate(prompt, params)[0]
        whole = server.client.completions.create(model="flash", prompt=prompt, max_tokens=16, **GREEDY)
        chunks = list(
            server.client.completions.create(model="flash", prompt=prompt, max_tokens=16, stream=True, **GREEDY)
        )
        assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == expected.text
        assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"


def test_stop_strings_cut_streamed_text_like_whole_text(server, oracle):
    full = oracle.generate("Hello there", SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0].text
    stop = full[9:12]
    kwargs = {"model": "flash", "prompt": "Hello there", "max_tokens": 30, "stop": [stop], **GREEDY}
    whole = server.client.completions.create(**kwargs)
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs))
    assert whole.choices[0].text == streamed == full[: full.index(stop)]
    assert whole.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_requests_of_different_lengths(server, oracle):
    batch = prompts(*(13 * i + 5 for i in range(16)), seed=9)
    max_tokens = [4 + i % 5 for i in range(16)]
    expected = [
        oracle.generate(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].text
        for p, n in zip(batch, max_tokens, strict=True)
    ]

    def complete(i: int) -> str:
        stream = i % 2 == 1
        kwargs = {"model": "flash", "prompt": batch[i], "max_tokens": max_tokens[i], **GREEDY}
        if stream:
            return "".join(c.choices[0].text for c in server.client.completions.create(stream=True, **kwargs))
        return server.client.completions.create(**kwargs).choices[0].text

    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(complete, range(16)))
    assert got == expected
    assert server.wait_metric("flashgate_kv_used_tokens", lambda v: v == 0) == 0
    metrics = server.metrics()
    assert metrics["flashgate_requests_running"] == metrics["flashgate_requests_waiting"] == 0


def test_a_prompt_that_reaches_the_context_length_is_refused(server):
    with pytest.raises(openai.BadRequestError) as raised:
        server.client.completions.create(model="flash", prompt=[7] * CONTEXT_LENGTH, max_tokens=1)
    error = raised.value.body
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert f"{CONTEXT_LENGTH} tokens" in error["message"] and f"context_length {CONTEXT_LENGTH}" in error["message"]
    long_chat = [{"role": "user", "content": "word " * CONTEXT_LENGTH}]
    with pytest.raises(openai.BadRequestError) as raised:
        server.client.chat.completions.create(model="flash", messages=long_chat)
    assert raised.value.body["param"] == "messages" and str(CONTEXT_LENGTH) in raised.value.body["message"]


def test_max_tokens_past_the_context_is_clamped_with_a_warning(server):
    (ids,) = prompts(CONTEXT_LENGTH - 6)
    response = server.client.completions.with_raw_response.create(model="flash", prompt=ids, max_tokens=100, **GREEDY)
    assert response.status_code == 200
    warning = response.headers["warning"]
    assert warning.startswith("299 ") and "max_tokens 100 clamped to 6" in warning and str(CONTEXT_LENGTH) in warning
    completion = response.parse()
    assert completion.usage.completion_tokens == 6 and completion.choices[0].finish_reason == "length"
    plain = server.client.completions.with_raw_response.create(model="flash", prompt=ids, max_tokens=6, **GREEDY)
    assert "warning" not in plain.headers


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        ({"model": "flash"}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": MESSAGES, "temperature": "hot"}, 400, "temperature"),
        ({"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
        ({"messages": MESSAGES, "max_tokens": 0}, 400, "max_tokens"),
        ({"messages": MESSAGES, "n": 2}, 400, "n"),
        ({"messages": MESSAGES, "stop": [""]}, 400, "stop"),
        ({"messages": MESSAGES, "stream_options": {"include_usage": "yes"}}, 400, "stream_options.include_usage"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
        (
            {"messages": MESSAGES, "reasoning_effort": "high", "chat_template_kwargs": {"thinking": False}},
            400,
            "reasoning_effort",
        ),  # fmt: skip
        ({"messages": MESSAGES, "model": "gpt-4o"}, 404, "model"),
    ],
)
def test_malformed_chat_requests_get_openai_errors_naming_the_field(server, body, status, param):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = server.http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param and error["message"]


def test_malformed_completion_prompts_and_unknown_routes(server):
    bad_id = server.http.post("/v1/completions", json={"prompt": [5, 99999], "max_tokens": 1})
    assert bad_id.status_code == 400 and bad_id.json()["error"]["param"] == "prompt" and "99999" in bad_id.text
    echo = server.http.post("/v1/completions", json={"prompt": "hi", "echo": True})
    assert echo.status_code == 400 and echo.json()["error"]["param"] == "echo"
    missing = server.http.get("/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_fields_agents_send_are_accepted(server):
    response = server.client.chat.completions.create(
        model="flash",
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        max_completion_tokens=3,
        store=False,
        metadata={"run": "x"},
        parallel_tool_calls=True,
        tools=[],
        tool_choice="auto",
        response_format={"type": "text"},
        extra_body={"chat_template_kwargs": {"thinking": False}, "some_future_field": 1, "top_k": -1},
    )
    assert response.choices[0].finish_reason in ("length", "stop") and response.usage.completion_tokens <= 3


def test_offered_tools_are_declared_to_the_model(server):
    tool = {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
            "strict": False,
        },
    }
    plain = server.client.chat.completions.create(model="flash", messages=MESSAGES, max_tokens=2)
    offered = server.client.chat.completions.create(model="flash", messages=MESSAGES, max_tokens=2, tools=[tool])
    assert offered.usage.prompt_tokens > plain.usage.prompt_tokens + 100  # the "## Tools" section
    assert offered.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_logprobs_in_chat_and_completions(server):
    chat = server.client.chat.completions.create(
        model="flash", messages=MESSAGES, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY
    )
    entries = chat.choices[0].logprobs.content
    assert len(entries) == 4 and all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in entries)
    assert entries[0].logprob == max(t.logprob for t in entries[0].top_logprobs)  # greedy picks the top token
    streamed = server.client.chat.completions.create(
        model="flash", messages=MESSAGES, max_tokens=4, logprobs=True, stream=True, **GREEDY
    )
    streamed_entries = [
        e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed_entries] == [e.token for e in entries]
    completion = server.client.completions.create(model="flash", prompt="Hello", max_tokens=3, logprobs=1, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 3
    assert "".join(logprobs.tokens) == completion.choices[0].text


def test_thinking_puts_reasoning_in_reasoning_content(server):
    response = server.client.chat.completions.create(
        model="flash", messages=MESSAGES, max_tokens=8, reasoning_effort="high", **GREEDY
    )
    message = response.choices[0].message
    # The tiny model never closes its reasoning: everything it writes is reasoning, cut by the length limit.
    assert message.model_extra["reasoning_content"] and not message.content
    assert response.usage.completion_tokens_details.reasoning_tokens == 8


def test_a_client_that_disconnects_mid_stream_frees_its_pages(server):
    body = {"prompt": "A long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        for _ in range(3):
            next(line for line in lines if line)
        assert server.metrics()["flashgate_kv_used_tokens"] > 0
    # The connection is closed here, long before 400 tokens.
    assert server.wait_metric("flashgate_kv_used_tokens", lambda v: v == 0, timeout=10) == 0
    assert server.wait_metric("flashgate_requests_running", lambda v: v == 0, timeout=10) == 0
    assert any(e["event"] == "request_aborted" for e in server.logs())


def test_a_whole_response_client_that_disconnects_frees_its_pages(server):
    body = {"prompt": "A long story", "max_tokens": 400, "ignore_eos": True}
    done = threading.Event()

    def post() -> None:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
        done.set()

    thread = threading.Thread(target=post)
    thread.start()
    server.wait_metric("flashgate_kv_used_tokens", lambda v: v > 0)
    thread.join()
    assert done.is_set()
    assert server.wait_metric("flashgate_kv_used_tokens", lambda v: v == 0, timeout=10) == 0


def test_metrics_carry_every_contract_name(server):
    text = server.http.get("/metrics").text
    metrics = server.metrics()
    for name in CONTRACT_METRICS:
        assert name in metrics, f"{name} missing from /metrics"
    assert "# TYPE flashgate_time_to_first_token_seconds histogram" in text
    assert "# TYPE flashgate_time_per_output_token_seconds histogram" in text
    assert metrics["flashgate_kv_capacity_tokens"] == server.http.get("/server_info").json()["kv_capacity_tokens"]
    assert metrics["flashgate_prompt_tokens_total"] > 0 and metrics["flashgate_generation_tokens_total"] > 0
    assert metrics["flashgate_time_to_first_token_seconds_count"] > 0


def test_metrics_count_steps_and_the_experts_each_moe_layer_read(server, oracle):
    """Between two scrapes, one request: a prefill step and max_tokens - 1 decode steps, and per kind and MoE layer
    the distinct routed experts of those steps, as the offline engine's gates pick them for the same request."""
    prompt, max_tokens = prompts(40, seed=11)[0], 5  # one prefill chunk in either engine
    before = server.metrics()
    server.client.completions.create(model="flash", prompt=prompt, max_tokens=max_tokens, **GREEDY)
    after = server.metrics()
    layers = oracle.engine.runner.model.layers
    picked: list[tuple[int, int, int]] = []  # per gate call: layer, tokens, distinct experts
    hooks = [
        layer.ffn.gate.register_forward_hook(
            lambda _m, _i, out, i=i: picked.append((i, len(out[1]), out[1].unique().numel()))
        )
        for i, layer in enumerate(layers)
    ]
    try:
        oracle.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        for hook in hooks:
            hook.remove()
    for kind, steps in (("prefill", 1), ("decode", max_tokens - 1)):
        calls = [(i, n) for i, tokens, n in picked if (tokens == 1) == (kind == "decode")]
        assert len(calls) == steps * len(layers)
        name = f'flashgate_steps_total{{kind="{kind}"}}'
        assert after[name] - before[name] == steps
        for i in range(len(layers)):
            name = f'flashgate_moe_experts_touched_total{{kind="{kind}",layer="{i}"}}'
            assert after[name] - before[name] == sum(n for layer, n in calls if layer == i), name


def test_nothing_was_logged_as_an_error(server):
    errors = [e for e in server.logs() if e["level"] in ("error", "critical")]
    assert not errors, errors
