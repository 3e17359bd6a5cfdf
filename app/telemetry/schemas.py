from __future__ import annotations

from dataclasses import asdict
from datetime import datetime

import msgspec

from app.telemetry.gpus import GpuSnapshot
from app.telemetry.service import EngineReading, TelemetrySample


class GpuRead(msgspec.Struct):
    """One GPU as NVML reports it; null where NVML cannot say (utilisation under WSL2)."""

    index: int
    name: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    temperature_c: int | None
    power_w: float | None
    utilization_pct: int | None


class GpusRead(msgspec.Struct):
    # NVML answered; otherwise `reason` says why (a CPU host).
    available: bool
    reason: str | None
    wsl: bool
    driver_version: str | None
    devices: list[GpuRead]
    notes: list[str]

    @classmethod
    def of(cls, snapshot: GpuSnapshot) -> GpusRead:
        return cls(
            available=snapshot.available,
            reason=snapshot.reason,
            wsl=snapshot.wsl,
            driver_version=snapshot.driver_version,
            devices=[GpuRead(**asdict(g)) for g in snapshot.gpus],
            notes=snapshot.notes,
        )


class EngineTelemetryRead(msgspec.Struct, kw_only=True):
    """The ready engine's own numbers: /metrics, and /server_info for the concurrency at full context."""

    run_id: int
    profile: str
    kv_capacity_tokens: int | None
    kv_used_tokens: int | None
    # kv_used_tokens / kv_capacity_tokens.
    kv_usage: float | None
    max_concurrency_at_full_context: float | None
    requests_running: int | None
    requests_waiting: int | None
    # Differences of the engine's counters over the last sampling interval.
    generation_tokens_per_s: float | None
    prompt_tokens_per_s: float | None
    prompt_tokens_total: int | None
    generation_tokens_total: int | None
    preemptions_total: int | None
    prefix_cache_queries_tokens_total: int | None
    prefix_cache_hits_tokens_total: int | None
    # Hits / queries, null when the engine does not report both (or had no prompt yet).
    prefix_cache_hit_rate: float | None
    error: str | None

    @classmethod
    def of(cls, reading: EngineReading) -> EngineTelemetryRead:
        return cls(**asdict(reading), kv_usage=reading.kv_usage, prefix_cache_hit_rate=reading.prefix_cache_hit_rate)


class HistoryPoint(msgspec.Struct):
    at: datetime
    kv_used_tokens: int | None
    kv_capacity_tokens: int | None
    generation_tokens_per_s: float | None
    requests_running: int | None
    requests_waiting: int | None
    # Per GPU, in NVML's order.
    gpu_free_bytes: list[int | None]

    @classmethod
    def of(cls, sample: TelemetrySample) -> HistoryPoint:
        engine = sample.engine
        return cls(
            at=sample.at,
            kv_used_tokens=engine.kv_used_tokens if engine else None,
            kv_capacity_tokens=engine.kv_capacity_tokens if engine else None,
            generation_tokens_per_s=engine.generation_tokens_per_s if engine else None,
            requests_running=engine.requests_running if engine else None,
            requests_waiting=engine.requests_waiting if engine else None,
            gpu_free_bytes=[g.free_bytes for g in sample.gpus.gpus],
        )


class TelemetryRead(msgspec.Struct):
    # When the latest sample was taken; null before the first one.
    sampled_at: datetime | None
    interval_s: float
    gpus: GpusRead | None
    # Null unless an engine is ready.
    engine: EngineTelemetryRead | None
    # Oldest first, one point per sampling interval (the last ten minutes at most).
    history: list[HistoryPoint]
