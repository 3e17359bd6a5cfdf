"""`/api/telemetry`: GPUs (NVML) and the ready engine's KV cache, requests and throughput, with recent history."""

from __future__ import annotations

from litestar import Controller, get
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide

from app.auth.guards import requires_viewer
from app.telemetry.schemas import EngineTelemetryRead, GpusRead, HistoryPoint, TelemetryRead
from app.telemetry.service import Telemetry


def provide_telemetry(state: State) -> Telemetry:
    return state.telemetry


def telemetry_read(telemetry: Telemetry) -> TelemetryRead:
    history = telemetry.history()
    latest = history[-1] if history else None
    return TelemetryRead(
        sampled_at=latest.at if latest else None,
        interval_s=telemetry.interval_s,
        gpus=GpusRead.of(latest.gpus) if latest else None,
        engine=EngineTelemetryRead.of(latest.engine) if latest and latest.engine else None,
        history=[HistoryPoint.of(s) for s in history],
    )


class TelemetryController(Controller):
    path = "/api/telemetry"
    tags = ["telemetry"]
    guards = [requires_viewer]
    dependencies = {"telemetry": Provide(provide_telemetry, sync_to_thread=False)}

    @get("/", operation_id="getTelemetry", sync_to_thread=False)
    def get_telemetry(self, telemetry: NamedDependency[Telemetry]) -> TelemetryRead:
        """The latest sample: per GPU name, total/used/free memory, temperature and power (null where NVML cannot
        say; `available: false` with the reason on a CPU host), and for a ready engine its KV capacity and usage in
        tokens, concurrency at full context, running/waiting requests and tokens per second; plus the history."""
        return telemetry_read(telemetry)
