"""Telemetry pieces: the Prometheus text reader, NVML degrading per metric (the real NvmlGpus over the fake pynvml),
the engine reading with rates from the engine's counters, and the history charts."""

from __future__ import annotations

import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pynvml
import pytest

from app.telemetry import prometheus
from app.telemetry.gpus import NvmlGpus, RankMemory, engine_gpu_indices, engine_ranks, host_is_wsl
from app.telemetry.plot import line_chart
from app.telemetry.service import EngineTarget, Telemetry
from tests.console.fake_nvml import GIB, FakeGpu, FakeNvml

# What the engine's /metrics answers (prometheus_client's exposition), trimmed to one bucket per histogram.
METRICS = """\
# HELP flashgate_time_to_first_token_seconds Seconds from a request's arrival to its first output token
# TYPE flashgate_time_to_first_token_seconds histogram
flashgate_time_to_first_token_seconds_bucket{le="0.01"} 0.0
flashgate_time_to_first_token_seconds_bucket{le="+Inf"} 3.0
flashgate_time_to_first_token_seconds_count 3.0
flashgate_time_to_first_token_seconds_sum 2.6150000000000002
# HELP flashgate_kv_capacity_tokens KV pool capacity in tokens
# TYPE flashgate_kv_capacity_tokens gauge
flashgate_kv_capacity_tokens 4096.0
flashgate_kv_used_tokens 512.0
flashgate_requests_running 1.0
flashgate_requests_waiting 0.0
flashgate_prompt_tokens_total {prompt}
flashgate_generation_tokens_total {generated}
flashgate_preemptions_total 0.0
"""


def metrics(prompt: int = 442, generated: int = 144) -> str:
    return METRICS.replace("{prompt}", f"{prompt}.0").replace("{generated}", f"{generated}.0")


def test_prometheus_text_is_read_by_name_with_labels():
    samples = prometheus.parse(metrics())
    assert prometheus.total(samples, "flashgate_kv_capacity_tokens") == 4096
    assert prometheus.total(samples, "flashgate_generation_tokens_total") == 144
    buckets = samples["flashgate_time_to_first_token_seconds_bucket"]
    assert [(b.labels["le"], b.value) for b in buckets] == [("0.01", 0.0), ("+Inf", 3.0)]
    assert prometheus.total(samples, "flashgate_missing") is None


def test_prometheus_edge_cases():
    text = 'a{path="/x\\"y\\\\z",code="200"} 3 1700000000\nb +Inf\nc NaN\nd not-a-number\n  \n# comment\ne{} -2.5e3'
    samples = prometheus.parse(text)
    assert samples["a"][0].labels == {"path": '/x"y\\z', "code": "200"} and samples["a"][0].value == 3
    assert samples["b"][0].value == math.inf and math.isnan(samples["c"][0].value)
    assert "d" not in samples and samples["e"][0].value == -2500
    assert prometheus.total(prometheus.parse('x{a="1"} 2\nx{a="2"} 3'), "x") == 5


def test_nvml_absent_is_said_not_zeroed():
    snapshot = NvmlGpus(nvml=FakeNvml(absent=True), wsl=False).read()
    assert snapshot.available is False and snapshot.gpus == []
    assert snapshot.reason == "no NVIDIA GPU (NVML unavailable: NVML Shared Library Not Found)"


def test_the_real_pynvml_says_why_here():
    """This machine has no NVIDIA driver: the real module must degrade the same way, not raise."""
    snapshot = NvmlGpus().read()
    if snapshot.available:
        pytest.skip("an NVIDIA driver is present")
    assert snapshot.reason.startswith("no NVIDIA GPU (NVML unavailable:")


def test_nvml_on_a_gpu_host_and_under_wsl2():
    host = NvmlGpus(nvml=FakeNvml([FakeGpu(used=41 * GIB)]), wsl=False).read()
    (gpu,) = host.gpus
    assert (gpu.total_bytes, gpu.used_bytes, gpu.free_bytes) == (141 * GIB, 41 * GIB, 100 * GIB)
    assert gpu.utilization_pct == 37 and gpu.power_w == 74.0 and gpu.temperature_c == 34
    assert host.notes == [] and host.driver_version == "570.124.06"
    wsl = NvmlGpus(nvml=FakeNvml(wsl=True), wsl=True).read()
    assert wsl.gpus[0].utilization_pct is None and wsl.gpus[0].free_bytes == 140 * GIB
    assert wsl.wsl and "WSL2" in wsl.notes[0]


def test_one_failing_metric_leaves_the_others():
    class NoPower(FakeNvml):
        def nvmlDeviceGetPowerUsage(self, gpu):
            raise pynvml.NVMLError_NotSupported()

    (gpu,) = NvmlGpus(nvml=NoPower(), wsl=False).read().gpus
    assert gpu.power_w is None and gpu.temperature_c == 34 and gpu.free_bytes == 140 * GIB


def test_engine_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert engine_gpu_indices(4, 1) == [0] and engine_gpu_indices(4, 2) == [0, 1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert engine_gpu_indices(4, 1) == [2] and engine_gpu_indices(4, 4) == [2, 3]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-6c1f2a")
    assert engine_gpu_indices(4, 1) == [0]
    # The profile's gpus replace the console's CUDA_VISIBLE_DEVICES (they become the engine's), in rank order; one
    # the host lacks is kept, for the preflight to refuse by name.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert engine_gpu_indices(4, 2, [1, 0]) == [1, 0] and engine_gpu_indices(2, 2, [0, 5]) == [0, 5]


def test_engine_ranks_put_the_engines_memory_beside_each_gpu():
    info = {
        "gpu_memory": {"weights_bytes": 1, "kv_bytes": 2, "graph_bytes": 3},
        "gpu_memory_per_rank": [
            {"total_bytes": 9, "free_bytes": 1, "weights_bytes": 80, "kv_bytes": 40, "graph_bytes": 2},
            {"total_bytes": 9, "free_bytes": 1, "weights_bytes": 81, "kv_bytes": 41, "graph_bytes": 3},
        ],
    }
    assert engine_ranks([3, 1], info) == {3: RankMemory(0, 80, 40, 2), 1: RankMemory(1, 81, 41, 3)}
    # An engine that reports rank 0 only, or nothing yet (starting).
    assert engine_ranks([0, 1], {"gpu_memory": info["gpu_memory"]}) == {0: RankMemory(0, 1, 2, 3), 1: RankMemory(1)}
    assert engine_ranks([0], None) == {0: RankMemory(0)}


def test_wsl_is_read_from_proc_version(tmp_path):
    version = tmp_path / "version"
    version.write_text("Linux version 5.15.167.4-microsoft-standard-WSL2 (root@f9c826d3017f)")
    assert host_is_wsl(version) is True
    version.write_text("Linux version 6.8.0-45-generic (buildd@lcy02-amd64-115)")
    assert host_is_wsl(version) is False and host_is_wsl(tmp_path / "missing") is False


@pytest.fixture
def metrics_endpoint():
    """A loopback HTTP endpoint answering the next of the given /metrics bodies on each call."""
    bodies: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = (bodies.pop(0) if len(bodies) > 1 else bodies[0]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


def test_rates_come_from_the_engines_counters(metrics_endpoint):
    url, bodies = metrics_endpoint
    bodies += [metrics(100, 40), metrics(300, 140), metrics(0, 0)]
    info = {"kv_capacity_tokens": 4096, "max_concurrency_at_full_context": 4.0}
    target = EngineTarget(run_id=7, profile="cpu-demo-1k", base_url=url, server_info=info)
    telemetry = Telemetry(NvmlGpus(nvml=FakeNvml(absent=True)), lambda: target, interval_s=1)
    first = telemetry.sample().engine
    assert first.generation_tokens_per_s is None and first.kv_used_tokens == 512 and first.kv_usage == 0.125
    assert first.max_concurrency_at_full_context == 4.0 and first.error is None
    second = telemetry.sample()
    elapsed = second.monotonic - telemetry.history()[0].monotonic
    assert second.engine.generation_tokens_per_s == pytest.approx(100 / elapsed)
    assert second.engine.prompt_tokens_per_s == pytest.approx(200 / elapsed)
    # Counters that went down: the engine restarted, no rate across that.
    assert telemetry.sample().engine.generation_tokens_per_s is None
    assert len(telemetry.history()) == 3


def test_an_engine_without_metrics_is_an_error_not_zeros():
    target = EngineTarget(run_id=1, profile="p", base_url="http://127.0.0.1:9", server_info={})
    reading = Telemetry(NvmlGpus(nvml=FakeNvml(absent=True)), lambda: target, interval_s=1).sample().engine
    assert reading.error.startswith("/metrics did not answer") and reading.kv_used_tokens is None


def test_charts_leave_gaps_and_put_the_newest_sample_on_the_right():
    chart = line_chart("KV", [None, 10, 20, None, 40], slots=5, interval_s=2, fmt=str, top=40)
    assert chart.line == "M80.0,72.5 L160.0,49.0 M320.0,2.0"
    assert chart.top_label == "40" and chart.latest_label == "40" and chart.span_label == "last 10 s"
    empty = line_chart("KV", [None, None], slots=150, interval_s=2, fmt=str)
    assert empty.empty and empty.latest_label == "n/a" and empty.span_label == "last 5 min"
    short = line_chart("tok/s", [1.0], slots=4, interval_s=2, fmt=lambda n: f"{n:.1f}")
    assert short.line.startswith("M320.0,") and short.top_label == "1.1"
