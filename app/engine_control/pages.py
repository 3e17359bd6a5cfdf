"""The dashboard (engine state and controls, boot timeline, KV cache, GPUs, requests, throughput, history) and the
engine run pages with their logs. The live part is one partial that htmx polls, so nothing needs a page reload."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from litestar import Controller, Response, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, URLEncodedBody
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Redirect, Template
from litestar.status_codes import HTTP_200_OK
from sqlmodel import Session, select

from app.audit.alerts import alerts
from app.auth.guards import requires_operator, requires_viewer
from app.console import redirect
from app.engine_control import service
from app.engine_control.checkpoint import DemoCheckpoint
from app.engine_control.schemas import RunRead
from app.engine_control.slot import EngineSlot
from app.errors import FieldError, InvalidFields
from app.profiles.models import Profile
from app.profiles.service import ProfileFacts, ProfileService
from app.settings import Settings
from app.telemetry.gpus import GIB, GpuSnapshot, RankMemory, engine_gpu_indices, engine_ranks, listed_indices
from app.telemetry.plot import Chart, line_chart
from app.telemetry.service import EngineReading, Telemetry, TelemetrySample

DASHBOARD = "/dashboard"
# Five minutes of history at the default two-second interval.
CHART_SLOTS = 150
LOG_PAGE_LINES = 500


@dataclass(frozen=True)
class Dashboard:
    session: Session
    settings: Settings
    slot: EngineSlot
    checkpoint: DemoCheckpoint
    telemetry: Telemetry
    profile_facts: ProfileFacts

    def _chart(
        self,
        title: str,
        pick: Callable[[TelemetrySample], float | None],
        fmt: Callable[[float], str],
        top: float | None = None,
    ) -> Chart:
        values = [pick(s) for s in self.telemetry.history()]
        return line_chart(title, values, slots=CHART_SLOTS, interval_s=self.telemetry.interval_s, fmt=fmt, top=top)

    def _charts(self, run: RunRead | None, gpus: GpuSnapshot | None) -> list[Chart]:
        def engine(read: Callable[[EngineReading], float | None]) -> Callable[[TelemetrySample], float | None]:
            return lambda sample: read(sample.engine) if sample.engine else None

        charts = [
            self._chart(
                "KV cache used (tokens)",
                engine(lambda e: e.kv_used_tokens),
                lambda n: f"{n:,.0f}",
                top=run.kv_capacity_tokens if run else None,
            ),
            self._chart(
                "Generation throughput", engine(lambda e: e.generation_tokens_per_s), lambda n: f"{n:,.1f} tok/s"
            ),
            self._chart("Requests running", engine(lambda e: e.requests_running), lambda n: f"{n:,.0f}"),
        ]
        if gpus and gpus.available and all(g.total_bytes for g in gpus.gpus):
            charts.append(
                self._chart(
                    "Free VRAM, all GPUs",
                    lambda sample: sum(g.free_bytes or 0 for g in sample.gpus.gpus) if sample.gpus.gpus else None,
                    lambda n: f"{n / GIB:,.1f} GiB",
                    top=sum(g.total_bytes for g in gpus.gpus),
                )
            )
        return charts

    def _ranks(self, run: RunRead | None, gpus: GpuSnapshot | None) -> dict[int, RankMemory]:
        """The live engine's GPUs by NVML index: the ones its environment named (the profile's `gpus`), else the
        first tensor_parallel_size the console sees; with the engine's memory on each once it is ready."""
        if run is None or not run.state.live or gpus is None or not gpus.available:
            return {}
        indices = listed_indices(run.environment.get("CUDA_VISIBLE_DEVICES"))
        if indices is None:
            applied = (run.server_info or {}).get("config") or {}
            tp = applied.get("tensor_parallel_size")
            if not isinstance(tp, int):
                tp = self.session.exec(select(Profile.tensor_parallel_size).where(Profile.name == run.profile)).first()
            indices = engine_gpu_indices(len(gpus.gpus), tp or 1)
        return engine_ranks(indices, run.server_info)

    def context(self, selected: str | None = None) -> dict[str, Any]:
        """Everything the live partial shows; `selected` keeps the operator's choice of profile across refreshes."""
        engine = service.engine_status(self.session, self.slot, self.checkpoint)
        run = engine.run
        latest = self.telemetry.latest()
        reading = latest.engine if latest and latest.engine and run and latest.engine.run_id == run.id else None
        profiles = [
            p
            for p in ProfileService(self.session, self.settings.models_dir, self.profile_facts).read_all()
            if not p.state.retired
        ]
        startable = [p.name for p in profiles if not p.state.blockers]
        if selected not in startable:
            selected = run.profile if run and run.profile in startable else next(iter(startable), None)
        gpus = latest.gpus if latest else None
        return {
            "engine": engine,
            "run": run,
            "live": run is not None and run.state.live,
            "reading": reading,
            "gpus": gpus,
            "ranks": self._ranks(run, gpus),
            "profiles": profiles,
            "selected": selected,
            "runs": service.list_runs(self.session, 8),
            "charts": self._charts(run, latest.gpus if latest else None),
        }

    def after_command(self, request: HTMXRequest) -> Response:
        """htmx swaps the fresh live partial in; a plain form goes back to the dashboard."""
        if request.htmx:
            return Template("engine/_live.html", context=self.context())
        return redirect(request, DASHBOARD)


def provide_dashboard(db_session: NamedDependency[Session], state: State) -> Dashboard:
    return Dashboard(db_session, state.settings, state.slot, state.checkpoint, state.telemetry, state.profile_facts)


class DashboardPages(Controller):
    guards = [requires_viewer]
    dependencies = {"dashboard": Provide(provide_dashboard, sync_to_thread=False)}

    @get("/", sync_to_thread=False)
    def home(self) -> Redirect:
        return Redirect(DASHBOARD)

    @get(DASHBOARD, sync_to_thread=True)
    def dashboard_page(self, dashboard: NamedDependency[Dashboard]) -> Template:
        # The production watch's open alerts head the page (their partial refreshes itself).
        return Template("dashboard.html", context=dashboard.context() | {"alerts": alerts(dashboard.session)})

    @get(f"{DASHBOARD}/live", sync_to_thread=True)
    def live(self, dashboard: NamedDependency[Dashboard], profile: FromQuery[str | None] = None) -> Template:
        return Template("engine/_live.html", context=dashboard.context(profile))

    @post("/engine/start", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def start(
        self, request: HTMXRequest, dashboard: NamedDependency[Dashboard], data: URLEncodedBody[dict[str, str]]
    ) -> Response:
        if not (profile := data.get("profile", "").strip()):
            raise InvalidFields([FieldError("profile", "profile is required: choose the profile to start")])
        with dashboard.slot.holding(f"{request.user.name}'s start"):
            dashboard.slot.supervisor.start(request.user.name, profile)
        return dashboard.after_command(request)

    @post("/engine/stop", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def stop(self, request: HTMXRequest, dashboard: NamedDependency[Dashboard]) -> Response:
        with dashboard.slot.holding(f"{request.user.name}'s stop"):
            dashboard.slot.supervisor.stop(request.user.name, keep_stopped=True)
        return dashboard.after_command(request)

    @post("/engine/restart", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def restart(self, request: HTMXRequest, dashboard: NamedDependency[Dashboard]) -> Response:
        with dashboard.slot.holding(f"{request.user.name}'s restart"):
            dashboard.slot.supervisor.restart(request.user.name, None)
        return dashboard.after_command(request)

    @get("/engine/runs/{run_id:int}", sync_to_thread=True)
    def run_page(self, dashboard: NamedDependency[Dashboard], run_id: FromPath[int]) -> Template:
        context = {
            "run": service.get_run(dashboard.session, run_id),
            "log": service.log_tail(dashboard.session, run_id, LOG_PAGE_LINES),
        }
        return Template("engine/run.html", context=context)

    @get("/engine/runs/{run_id:int}/log", sync_to_thread=True)
    def run_log(self, dashboard: NamedDependency[Dashboard], run_id: FromPath[int]) -> Template:
        context = {
            "run": service.get_run(dashboard.session, run_id),
            "log": service.log_tail(dashboard.session, run_id, LOG_PAGE_LINES),
        }
        return Template("engine/_log.html", context=context)
