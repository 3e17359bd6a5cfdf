"""The gates' pure logic: how a plan scales with the profile and the host, the tool-call validator, the reference's
performance formulas, how streams are reassembled, how evidence shortens long text, the VRAM and log gates on
what the ladder kept, and the report's bar geometry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.qualification.client import MAX_TEXT, EngineClient, Exchange, shorten
from app.qualification.gates import GATES, LADDER
from app.qualification.gates.base import (
    NEEDLE_SENTENCE,
    Calibration,
    GateContext,
    LadderPlan,
    finish_problem,
    haystack,
    percentile,
    tool_call_problems,
)
from app.qualification.gates.context import ClientShapes
from app.qualification.gates.performance import request_metrics
from app.qualification.models import GateStatus
from app.qualification.plot import PLOT_W, bar_chart

GIB = 1 << 30


def plan(context: int, device: str | None = "cuda", **limits: int) -> LadderPlan:
    values = {"context_length": context, "max_num_seqs": 4, "max_num_batched_tokens": 512, **limits}
    return LadderPlan.of("p", values, device, 3.0, (0,))


def test_the_cpu_demo_ladder_is_scaled_down():
    demo = plan(4096, "cpu")
    assert demo.scale == "demo" and demo.max_tokens <= 64 and demo.burst == 3
    assert demo.needle_target_tokens == 3072  # ~0.75 of the demo context
    shape = demo.perf_shape
    assert shape["planned_context"] == 4096 and shape["max_tokens"] <= 64 and shape["requests"] == 3
    assert shape["prompt_chars"] == 3 * shape["prompt_budget_tokens"] < 3 * 4096


@pytest.mark.parametrize(
    ("context", "max_tokens", "needle"),
    [(131_072, 2560, 131_072 - 2560 - 1310), (650_000, 4608, 650_000 - 4608 - 6500), (1_000_000, 4608, 985_392)],
)
def test_the_full_ladder_follows_the_field_envelope(context, max_tokens, needle):
    full = plan(context)
    assert full.scale == "full" and full.burst == 20 and full.tools_system_repeats == 400
    assert full.max_tokens == max_tokens and full.needle_target_tokens == needle
    # Matched performance: 32K planned context, 1024 out, the same shape whatever the profile's context beyond it.
    assert full.perf_shape == plan(262_144).perf_shape
    assert full.perf_shape["planned_context"] == 32_768 and full.perf_shape["max_tokens"] == 1024


def test_a_short_context_caps_the_shapes():
    small = plan(16_384)
    assert small.perf_shape["planned_context"] == 16_384
    assert small.perf_shape["prompt_budget_tokens"] == 16_384 - 1024 - 1024
    shapes = {s["name"]: s for s in ClientShapes.shapes(small)}
    assert shapes["openclaw"]["capped"] and shapes["openclaw"]["max_tokens"] == 8192
    assert shapes["openclaw"]["prompt_tokens"] + 8192 + small.reserve_tokens == 16_384
    assert shapes["pi_long_output"]["max_tokens"] == 8192  # 32,768 out cannot fit: half the context at most


def test_gate_definitions_are_versioned_and_unique():
    assert len(GATES) == len(LADDER) == 13
    for gate in LADDER:
        definition = gate.definition()
        assert definition["version"] >= 1 and definition["kind"] in ("structural", "capability")
        assert gate.inputs(plan(8192)) is not None


def call(name: str = "get_weather", arguments: str = '{"city": "Oakland"}', content: str = "") -> Exchange:
    exchange = Exchange("t", "POST", "/v1/chat/completions", {}, status=200, content=content)
    exchange.tool_calls = [{"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}]
    return exchange


def test_the_tool_call_validator():
    assert tool_call_problems(call()) == []
    assert tool_call_problems(call(name="weather")) == ["the first call is 'weather', not 'get_weather'"]
    assert tool_call_problems(call(arguments="{city: Oakland")) == ["arguments are not JSON: '{city: Oakland'"]
    assert tool_call_problems(call(arguments='{"city": ""}')) == ["arguments lack a non-empty string `city`"]
    assert tool_call_problems(call(arguments="[1]")) == ["arguments are not a JSON object"]
    leaked = call(content="<｜DSML｜tool_calls>")
    assert tool_call_problems(leaked) == [
        "garbage marker '｜DSML｜' in the content",
        "garbage marker '<｜' in the content",
    ]
    none = Exchange("t", "POST", "/", {}, status=200)
    assert tool_call_problems(none) == ["no tool_calls"]
    assert finish_problem(none) == ["finish_reason None (the evidence policy needs stop or tool_calls)"]
    refused = Exchange("t", "POST", "/", {}, status=400, body={"error": {"message": "bad tools"}})
    assert finish_problem(refused) == ["HTTP 400: bad tools"]
    gone = Exchange("t", "POST", "/", {}, error="ConnectError: refused")
    assert finish_problem(gone) == ["no answer (ConnectError: refused)"]


def test_the_reference_performance_formulas():
    exchange = Exchange("p", "POST", "/", {}, status=200, seconds=5.0, ttfo_s=1.0, ttft_s=2.0, done=True)
    exchange.usage = {"prompt_tokens": 8000, "completion_tokens": 401, "prompt_tokens_details": {"cached_tokens": 64}}
    metrics = request_metrics(exchange)
    assert metrics["prefill_tok_s"] == 8000.0  # prompt tokens / TTFO
    assert metrics["generation_s"] == 4.0 and metrics["decode_tok_s"] == 100.0  # (401 − 1) / (E2E − TTFO)
    assert metrics["itl_s"] == 0.01 and metrics["cached_tokens"] == 64 and metrics["visible"] is False
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([1.0, 2.0, 3.0], 0.95) == pytest.approx(2.9)
    assert percentile([], 0.5) is None


def test_a_stream_is_reassembled_by_index():
    exchange = Exchange("s", "POST", "/", {}, stream=True)
    calls: dict = {}
    chunks = [
        {"choices": [{"delta": {"reasoning_content": "think"}}]},
        {
            "choices": [
                {"delta": {"tool_calls": [{"index": 0, "id": "c1", "function": {"name": "get_", "arguments": ""}}]}}
            ]
        },
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"name": "weather", "arguments": '{"ci'}}]}}]},
        {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oakland"}'}}]}}]},
        {"choices": [{"delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7}},
    ]
    for at, chunk in enumerate(chunks, 1):
        EngineClient._read_chunk(exchange, chunk, calls, at / 10)
    exchange.tool_calls = [calls[i] for i in sorted(calls)]
    assert exchange.ttfo_s == 0.1 and exchange.ttft_s is None and exchange.reasoning == "think"
    assert exchange.finish_reason == "tool_calls" and exchange.usage["completion_tokens"] == 7
    exchange.status = 200
    assert tool_call_problems(exchange) == []


def test_evidence_keeps_long_text_short_and_identifiable():
    text = "x" * 10_000
    short = shorten({"messages": [{"content": text}], "n": 1})
    kept = short["messages"][0]["content"]
    assert len(kept) < MAX_TEXT + 100 and "10,000 chars, sha256 " in kept and short["n"] == 1
    assert shorten("short") == "short"


def test_the_haystack_puts_the_needle_at_58_percent():
    sentences = haystack(100, 0.58).split(". ")
    assert sentences.index(NEEDLE_SENTENCE.rstrip(".")) == 58
    assert NEEDLE_SENTENCE not in haystack(10, None)
    calibration = Calibration(sentence_tokens=15.0, overhead_tokens=30.0)
    assert calibration.sentences_for(1530) == 100


def context(samples: list[dict] | None = None, log_path: Path | None = None) -> GateContext:
    return GateContext(
        client=None,
        plan=plan(4096),
        observe=lambda gate, payload: None,
        report=lambda step: None,
        health=lambda: True,
        read_gpus=lambda: {"available": False, "reason": "no NVIDIA GPU", "gpus": []},
        boot={},
        log_path=log_path,
        samples=samples or [],
    )


def sample(point: str, free_gib: float) -> dict:
    gpu = {"index": 0, "name": "H200", "free_bytes": int(free_gib * GIB), "total_bytes": 141 * GIB}
    return {"point": point, "available": True, "reason": None, "gpus": [gpu]}


def test_the_vram_reserve_gate():
    vram = GATES["vram_reserve"]
    inputs = vram.inputs(plan(4096))
    assert vram.run(context(), inputs).status is GateStatus.na
    points = ["idle", "after_needle", "after_benchmark"]
    kept = vram.run(context([sample(p, 10) for p in points]), inputs)
    assert kept.status is GateStatus.passed and kept.measurements["min_free_gib"] == 10
    tight = vram.run(context([sample("idle", 10), sample("after_needle", 0.2), sample("after_benchmark", 4)]), inputs)
    assert tight.status is GateStatus.failed and tight.summary == "after_needle: GPU 0 has 0.20 GiB free < 3 GiB"
    short = vram.run(context([sample("idle", 10)]), inputs)
    assert short.summary == "not sampled after needle; not sampled after benchmark"


def gpus_sample(point: str, free_gib: tuple[float, ...], indices: tuple[int, ...] = (0, 1, 2)) -> dict:
    gpus = [
        {"index": i, "name": "H200", "free_bytes": int(f * GIB), "total_bytes": 141 * GIB}
        for i, f in zip(indices, free_gib, strict=True)
    ]
    return {"point": point, "available": True, "reason": None, "gpus": gpus}


def test_the_vram_reserve_gate_checks_each_gpu_of_the_engine():
    vram = GATES["vram_reserve"]
    # The engine on GPUs 2 and 0 (a profile's gpus); GPU 1 is another tenant's and may be full.
    inputs = vram.inputs(
        LadderPlan.of(
            "p", {"context_length": 4096, "max_num_seqs": 4, "max_num_batched_tokens": 512}, "cuda", 3.0, (2, 0)
        )
    )
    assert inputs["gpus"] == [2, 0]
    points = ["idle", "after_needle", "after_benchmark"]
    kept = vram.run(context([gpus_sample(p, (8, 0.1, 5)) for p in points]), inputs)
    assert kept.status is GateStatus.passed and kept.measurements["min_free_gib"] == 5
    low = [gpus_sample("idle", (8, 0.1, 5)), gpus_sample("after_needle", (8, 0.1, 2.5))]
    tight = vram.run(context([*low, gpus_sample("after_benchmark", (1, 0.1, 5))]), inputs)
    assert tight.status is GateStatus.failed and tight.summary == (
        "after_needle: GPU 2 has 2.50 GiB free < 3 GiB; after_benchmark: GPU 0 has 1.00 GiB free < 3 GiB"
    )
    # A reading without one of the engine's GPUs fails, naming it, instead of passing on the others.
    lost = [gpus_sample(p, (8, 8), (0, 1)) for p in points]
    gone = vram.run(context(lost), inputs)
    assert gone.status is GateStatus.failed and gone.summary.startswith(
        "idle: GPU 2 of the engine not in NVML's reading"
    )


def test_the_log_scan(tmp_path):
    scan = GATES["log_scan"]
    log = tmp_path / "run.log"
    lines = [
        json.dumps({"event": "boot_stage", "level": "info"}),
        "engine ready: context_len=1024",
        json.dumps({"event": "request_refused", "level": "warning", "status": 503}),
        "Traceback (most recent call last):",
        "torch.OutOfMemoryError: CUDA out of memory",
    ]
    log.write_text("\n".join(lines) + "\n")
    found = scan.run(context(log_path=log), {})
    assert found.status is GateStatus.failed
    assert found.measurements == {
        "hits": 3,
        "lines_scanned": 5,
        "kinds": {"http_error": 1, "traceback": 1, "out_of_memory": 1},
    }
    log.write_text("\n".join(lines[:2]) + "\n")
    assert scan.run(context(log_path=log), {}).status is GateStatus.passed
    assert scan.run(context(log_path=None), {}).status is GateStatus.na


def test_the_performance_bars_scale_to_the_largest_value():
    mine = {"p50": {"ttfo_s": 1.0, "e2e_s": 4.0}, "p95": {"ttfo_s": 2.0, "e2e_s": 5.0}}
    theirs = {"p50": {"ttfo_s": 1.5, "e2e_s": 3.0}}
    chart = bar_chart("Latency", "s", [("ttfo_s", "TTFO"), ("e2e_s", "E2E")], mine, theirs, "prod", "")
    ttfo, e2e = chart.rows
    assert [b.series for b in ttfo.bars] == ["this run", "prod"]
    assert e2e.bars[0].p95_x - chart.plot_x == pytest.approx(PLOT_W * 5.0 / 5.4)
    assert ttfo.bars[1].width == pytest.approx(PLOT_W * 1.5 / 5.4) and not chart.empty
    assert bar_chart("Latency", "s", [("ttft_s", "TTFT")], mine, None, None, "").empty
