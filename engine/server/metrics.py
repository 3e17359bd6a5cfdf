"""GET /metrics: the contract's `flashgate_*` Prometheus names. Gauges and counters are read from the engine loop's
last published stats at scrape time; the latency histograms are observed by the loop as requests progress.

The prefix cache: `flashgate_prefix_cache_queries_tokens_total` and `flashgate_prefix_cache_hits_tokens_total`
(prompt tokens looked up, and found), `flashgate_prefix_cache_pages`. Beyond the contract, for benchmarks and capacity
planning: `flashgate_steps_total{kind}` (decode or prefill steps
run) and `flashgate_moe_experts_touched_total{kind,layer}` (distinct routed experts each MoE layer read, summed over
those steps; decode steps replayed from CUDA graphs include their padding rows). The expert counts live on the
device and are copied from it at scrape time only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.model_runner import ExpertCounts

# Seconds; TTFT spans a tiny CPU model's milliseconds up to a 1M-token prefill's minutes.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


@dataclass(frozen=True)
class EngineStats:
    kv_capacity_tokens: int
    kv_used_tokens: int = 0  # pages held by requests x page_size
    running: int = 0
    waiting: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_cached_pages: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    expert_counts: ExpertCounts | None = None  # live counters, read when scraped


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.time_to_first_token = Histogram(
            "flashgate_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token",
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "flashgate_time_per_output_token_seconds",
            "Per finished request: seconds per output token after the first",
            buckets=TPOT_BUCKETS,
            registry=self.registry,
        )
        self._collector = _StatsCollector()
        self.registry.register(self._collector)

    def render(self, stats: EngineStats) -> bytes:
        self._collector.stats = stats
        return generate_latest(self.registry)


class _StatsCollector(Collector):
    stats: EngineStats | None = None

    def collect(self):
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily("flashgate_kv_capacity_tokens", "KV pool capacity in tokens", s.kv_capacity_tokens)
        yield GaugeMetricFamily(
            "flashgate_kv_used_tokens", "KV tokens held by requests (whole pages)", s.kv_used_tokens
        )
        yield GaugeMetricFamily("flashgate_requests_running", "Requests running", s.running)
        yield GaugeMetricFamily("flashgate_requests_waiting", "Requests waiting for a running slot", s.waiting)
        yield CounterMetricFamily("flashgate_prompt_tokens", "Prompt tokens processed", s.prompt_tokens)
        yield CounterMetricFamily("flashgate_generation_tokens", "Output tokens generated", s.generation_tokens)
        yield CounterMetricFamily("flashgate_preemptions", "Requests preempted by recompute", s.preemptions)
        yield CounterMetricFamily(
            "flashgate_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_queried_tokens,
        )
        yield CounterMetricFamily(
            "flashgate_prefix_cache_hits_tokens", "Prompt tokens taken from the prefix cache", s.prefix_hit_tokens
        )
        yield GaugeMetricFamily(
            "flashgate_prefix_cache_pages", "KV pages cached prefixes hold (free to take when needed)",
            s.prefix_cached_pages,
        )  # fmt: skip
        if s.expert_counts is None:
            return
        counts = s.expert_counts.read()
        steps = CounterMetricFamily(
            "flashgate_steps", "Steps run: decode (one token per request) or prefill (prompt tokens)", labels=["kind"]
        )
        touched = CounterMetricFamily(
            "flashgate_moe_experts_touched",
            "Distinct routed experts each MoE layer read, summed over the steps of a kind",
            labels=["kind", "layer"],
        )
        for kind, (n_steps, per_layer) in counts.items():
            steps.add_metric([kind], n_steps)
            for layer, n in enumerate(per_layer):
                touched.add_metric([kind, str(layer)], n)
        yield steps
        yield touched
