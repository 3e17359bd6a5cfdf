"""Live telemetry: the GPUs through NVML and the engine's own /metrics, sampled on an interval into a small
in-memory history for the dashboard's plot. Numbers are what the engine and NVML report; rates are differences of
the engine's counters between two samples, never estimates."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import httpx
import structlog

from app.db import utcnow
from app.telemetry import prometheus
from app.telemetry.gpus import Gpus, GpuSnapshot

log = structlog.get_logger(__name__)

# Ten minutes at the default two-second interval.
HISTORY_SAMPLES = 300


@dataclass(frozen=True)
class EngineTarget:
    """The engine telemetry reads: a ready run, where it answers, and its /server_info from when it got ready."""

    run_id: int
    profile: str
    base_url: str
    server_info: dict[str, Any]


@dataclass(frozen=True)
class EngineReading:
    run_id: int
    profile: str
    kv_capacity_tokens: int | None
    kv_used_tokens: int | None
    max_concurrency_at_full_context: float | None
    requests_running: int | None
    requests_waiting: int | None
    prompt_tokens_total: int | None
    generation_tokens_total: int | None
    preemptions_total: int | None
    # Prompt tokens looked up in the prefix cache, and found there; None when the engine does not report them.
    prefix_cache_queries_tokens_total: int | None
    prefix_cache_hits_tokens_total: int | None
    # Tokens per second over the last interval; None for the first sample of a run.
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    # /metrics did not answer or lacked the contract's names.
    error: str | None

    @property
    def kv_usage(self) -> float | None:
        if self.kv_used_tokens is None or not self.kv_capacity_tokens:
            return None
        return self.kv_used_tokens / self.kv_capacity_tokens

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Hits over queries since the engine started; None (n/a, never 0 %) unless it reports both and was asked."""
        queries, hits = self.prefix_cache_queries_tokens_total, self.prefix_cache_hits_tokens_total
        if queries is None or hits is None or queries == 0:
            return None
        return hits / queries


@dataclass(frozen=True)
class TelemetrySample:
    at: datetime
    monotonic: float
    gpus: GpuSnapshot
    engine: EngineReading | None


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


class Telemetry:
    def __init__(
        self,
        gpus: Gpus,
        target: Callable[[], EngineTarget | None],
        interval_s: float,
        history: int = HISTORY_SAMPLES,
    ) -> None:
        self.gpus = gpus
        self.target = target
        self.interval_s = interval_s
        self._history: deque[TelemetrySample] = deque(maxlen=history)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._http = httpx.Client(timeout=2.0)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._http.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler that dies silently would freeze the dashboard; log and keep sampling
                log.exception("telemetry_sample_failed")
            self._stop.wait(self.interval_s)

    def latest(self) -> TelemetrySample | None:
        with self._lock:
            return self._history[-1] if self._history else None

    def history(self) -> list[TelemetrySample]:
        with self._lock:
            return list(self._history)

    def sample(self) -> TelemetrySample:
        gpus = self.gpus.read()
        target = self.target()
        previous = self.latest()
        now = time.monotonic()
        engine = self._read_engine(target, previous, now) if target else None
        sample = TelemetrySample(at=utcnow(), monotonic=now, gpus=gpus, engine=engine)
        with self._lock:
            self._history.append(sample)
        return sample

    def _read_engine(self, target: EngineTarget, previous: TelemetrySample | None, now: float) -> EngineReading:
        info = target.server_info
        try:
            response = self._http.get(f"{target.base_url}/metrics")
            response.raise_for_status()
            samples, error = prometheus.parse(response.text), None
        except httpx.HTTPError as exc:
            samples, error = {}, f"/metrics did not answer: {exc}"
        if not error and "flashgate_kv_used_tokens" not in samples:
            error = "/metrics lacks flashgate_kv_used_tokens"
        prompt = _int(prometheus.total(samples, "flashgate_prompt_tokens_total"))
        generated = _int(prometheus.total(samples, "flashgate_generation_tokens_total"))
        before = previous.engine if previous and previous.engine and previous.engine.run_id == target.run_id else None
        elapsed = now - previous.monotonic if previous else 0.0

        def rate(current: int | None, earlier: int | None) -> float | None:
            # A counter that went down means the engine restarted: no rate across that.
            if current is None or earlier is None or elapsed <= 0 or current < earlier:
                return None
            return (current - earlier) / elapsed

        capacity = _int(prometheus.total(samples, "flashgate_kv_capacity_tokens"))
        return EngineReading(
            run_id=target.run_id,
            profile=target.profile,
            kv_capacity_tokens=capacity if capacity is not None else info.get("kv_capacity_tokens"),
            kv_used_tokens=_int(prometheus.total(samples, "flashgate_kv_used_tokens")),
            max_concurrency_at_full_context=info.get("max_concurrency_at_full_context"),
            requests_running=_int(prometheus.total(samples, "flashgate_requests_running")),
            requests_waiting=_int(prometheus.total(samples, "flashgate_requests_waiting")),
            prompt_tokens_total=prompt,
            generation_tokens_total=generated,
            preemptions_total=_int(prometheus.total(samples, "flashgate_preemptions_total")),
            prefix_cache_queries_tokens_total=_int(
                prometheus.total(samples, "flashgate_prefix_cache_queries_tokens_total")
            ),
            prefix_cache_hits_tokens_total=_int(prometheus.total(samples, "flashgate_prefix_cache_hits_tokens_total")),
            generation_tokens_per_s=rate(generated, before.generation_tokens_total) if before else None,
            prompt_tokens_per_s=rate(prompt, before.prompt_tokens_total) if before else None,
            error=error,
        )
