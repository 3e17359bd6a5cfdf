"""Admission limits on their own engine processes: preemption by recompute when the KV pool is too small, the
bounded waiting queue, request timeouts, SIGTERM draining, and startup failures."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from engine import LLM, SamplingParams
from tests.support import ROOT, free_port

from .conftest import CONTEXT_LENGTH, DTYPE

pytestmark = pytest.mark.slow
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_a_pool_too_small_for_everyone_preempts_and_outputs_stay_the_same(tiny_dir, start_server):
    # 3 pages of 256 tokens for 4 requests that each grow to 2 pages: they cannot all hold their pages at once.
    # A recomputed request runs its generated tokens through prefill instead of decode steps; without the FP4/FP8
    # activation rounding (quant_sim) their last-bit differences cannot flip a rounding and then a greedy token.
    server = start_server(max_num_seqs=4, max_num_batched_tokens=256, num_kv_pages=3, quant_sim=False)
    gen = torch.Generator().manual_seed(11)
    batch = [torch.randint(2, 1024, (n,), generator=gen).tolist() for n in (200, 190, 210, 195)]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    oracle = LLM(str(tiny_dir), dtype=DTYPE, context_length=CONTEXT_LENGTH, quant_sim=False)
    expected = [o.text for o in oracle.generate(batch, params)]

    def complete(prompt: list[int]) -> str:
        return server.client.completions.create(model="tiny", prompt=prompt, max_tokens=60, **GREEDY).choices[0].text

    with ThreadPoolExecutor(len(batch)) as pool:
        assert list(pool.map(complete, batch)) == expected
    metrics = server.metrics()
    assert metrics["flashgate_preemptions_total"] > 0
    assert metrics["flashgate_kv_capacity_tokens"] == 768 and metrics["flashgate_kv_used_tokens"] == 0


@pytest.fixture(scope="module")
def one_slot(start_server):
    """One running slot, one waiting place, a 3-second request timeout and a 2-second shutdown grace."""
    return start_server(max_num_seqs=1, max_waiting_requests=1, request_timeout_s=3, shutdown_grace_s=2)


def test_beyond_the_waiting_queue_requests_get_429_with_retry_after(one_slot):
    long = {"prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=one_slot.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=long) as running,
    ):
        lines = running.iter_lines()  # held: a dropped line iterator would close the connection
        next(line for line in lines if line)  # it runs
        waiting: list[httpx.Response] = []
        waiter = threading.Thread(
            target=lambda: waiting.append(
                httpx.post(f"{one_slot.url}/v1/completions", json={"prompt": "Twice", "max_tokens": 2}, timeout=30)
            )
        )
        waiter.start()
        one_slot.wait_metric("flashgate_requests_waiting", lambda v: v == 1)
        refused = httpx.post(f"{one_slot.url}/v1/completions", json={"prompt": "Thrice", "max_tokens": 2})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["code"] == "queue_full" and "max_waiting_requests is 1" in error["message"]
    waiter.join()  # the running stream's client left, so the waiting request runs
    assert waiting[0].status_code == 200 and waiting[0].json()["usage"]["completion_tokens"] == 2


def test_a_request_past_its_timeout_ends_with_what_it_has(one_slot):
    started = time.monotonic()
    stream = one_slot.client.completions.create(
        model="tiny", prompt="Once", max_tokens=500, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    assert 2.5 < time.monotonic() - started < 10
    assert chunks[-2].choices[0].finish_reason == "length"
    assert 0 < chunks[-1].usage.completion_tokens < 500
    assert any(e["event"] == "request_timeout" for e in one_slot.logs())


def test_sigterm_drains_in_flight_requests_refuses_new_ones_and_exits_0(one_slot):
    with httpx.Client(base_url=one_slot.url, timeout=30) as client:
        body = {"prompt": "Once", "max_tokens": 30, "stream": True, "ignore_eos": True}
        with client.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            next(line for line in lines if line)
            one_slot.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 5
            while client.get("/health").status_code == 200:
                assert time.monotonic() < deadline, "still healthy after SIGTERM"
            refused = client.post("/v1/completions", json={"prompt": "late", "max_tokens": 1})
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]" and '"finish_reason": "length"' in rest[-2]
    assert one_slot.proc.wait(timeout=30) == 0
    events = [e["event"] for e in one_slot.logs()]
    assert "draining" in events and "drained" in events and "engine_stopped" in events


def test_sigterm_past_the_grace_period_aborts_what_is_left_and_still_exits_0(start_server):
    server = start_server(shutdown_grace_s=0.5)
    body = {"prompt": "Once", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=server.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        next(line for line in lines if line)
        server.proc.send_signal(signal.SIGTERM)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"code": "request_failed"' in rest[-2]
    assert server.proc.wait(timeout=30) == 0
    assert any(e["event"] == "drain_timeout" for e in server.logs())


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
        (["--num-kv-pages", "-3"], "num_kv_pages must be a positive integer"),
        (["--kv-cache-dtype", "int3"], "kv_cache_dtype must be one of"),
        (["--context-length", "999999"], "context_length 999999 exceeds the model's maximum 4096"),
    ],
)
def test_a_startup_failure_is_a_failed_boot_stage_and_a_non_zero_exit(tiny_dir, flags, message):
    command = [sys.executable, "-m", "engine", "serve", "--model", str(tiny_dir), "--port", str(free_port()), *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "engine ready" not in done.stdout
    failed = [line for line in done.stderr.splitlines() if '"boot_stage"' in line and '"failed"' in line]
    assert failed and message in failed[0], done.stderr


def test_a_missing_model_or_a_taken_port_fails_fast(tmp_path, tiny_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        for model, port, expected in (
            (tmp_path / "nowhere", free_port(), "nowhere"),
            (tiny_dir, busy, f"cannot bind 127.0.0.1:{busy}"),
        ):
            command = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(port)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=60)
            assert done.returncode == 1 and expected in done.stderr and '"stage": "failed"' in done.stderr
