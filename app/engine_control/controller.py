"""`/api/engine`: the engine's state, start / stop / restart with a profile, its runs and their logs."""

from __future__ import annotations

from typing import Annotated

from litestar import Controller, Request, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, JSONBody, QueryParameter
from litestar.status_codes import HTTP_200_OK, HTTP_202_ACCEPTED
from sqlmodel import Session

from app.auth.guards import requires_operator, requires_viewer
from app.engine_control import service
from app.engine_control.checkpoint import DemoCheckpoint
from app.engine_control.schemas import EngineRead, LogTail, RestartRequest, RunRead, StartRequest
from app.engine_control.slot import EngineSlot, Locked
from app.errors import Conflict


def provide_slot(state: State) -> EngineSlot:
    return state.slot


def provide_checkpoint(state: State) -> DemoCheckpoint:
    return state.checkpoint


ENGINE_DEPENDENCIES = {
    "slot": Provide(provide_slot, sync_to_thread=False),
    "checkpoint": Provide(provide_checkpoint, sync_to_thread=False),
}


class EngineController(Controller):
    path = "/api/engine"
    tags = ["engine"]
    guards = [requires_viewer]
    dependencies = ENGINE_DEPENDENCIES

    @get("/", operation_id="getEngine", sync_to_thread=True)
    def get_engine(
        self,
        db_session: NamedDependency[Session],
        slot: NamedDependency[EngineSlot],
        checkpoint: NamedDependency[DemoCheckpoint],
    ) -> EngineRead:
        """The engine's state (`idle` before any run, else the latest run's), its profile, boot stages, pid or
        container, KV capacity from /server_info, and the last error with the last log lines."""
        return service.engine_status(db_session, slot, checkpoint)

    @post(
        "/start",
        guards=[requires_operator],
        operation_id="startEngine",
        status_code=HTTP_202_ACCEPTED,
        raises=[Conflict, Locked],
        sync_to_thread=True,
    )
    def start(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        slot: NamedDependency[EngineSlot],
        checkpoint: NamedDependency[DemoCheckpoint],
        data: JSONBody[StartRequest],
    ) -> EngineRead:
        """Preflight, then start the engine with a profile; answers at once with state `starting` (poll
        `GET /api/engine` for `ready`). 409 with the reason when an engine already runs or the preflight refuses
        (each check is in `extra`); 404 for an unknown profile; 423 naming the holder while a qualification run, a
        switch or the production watch holds the engine."""
        with slot.holding(f"{request.user.name}'s start"):
            slot.supervisor.start(request.user.name, data.profile)
        return service.engine_status(db_session, slot, checkpoint)

    @post(
        "/stop",
        guards=[requires_operator],
        operation_id="stopEngine",
        status_code=HTTP_200_OK,
        raises=[Conflict, Locked],
        sync_to_thread=True,
    )
    def stop(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        slot: NamedDependency[EngineSlot],
        checkpoint: NamedDependency[DemoCheckpoint],
    ) -> EngineRead:
        """SIGTERM, up to FLASHGATE_ENGINE_GRACE_S to finish, then a kill; answers when the engine is gone, with
        whether the GPU memory came back. 409 when no engine runs. Production stopped here stays stopped when the
        console restarts (`keep_stopped`). 423 naming the holder while a run, a switch or the watch holds the
        engine: what they displaced comes back when they finish."""
        with slot.holding(f"{request.user.name}'s stop"):
            slot.supervisor.stop(request.user.name, keep_stopped=True)
        return service.engine_status(db_session, slot, checkpoint)

    @post(
        "/restart",
        guards=[requires_operator],
        operation_id="restartEngine",
        status_code=HTTP_202_ACCEPTED,
        raises=[Conflict, Locked],
        sync_to_thread=True,
    )
    def restart(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        slot: NamedDependency[EngineSlot],
        checkpoint: NamedDependency[DemoCheckpoint],
        data: JSONBody[RestartRequest | None] = None,
    ) -> EngineRead:
        """Stop the running engine (if any) and start `profile`, by default (or with no body) the latest run's
        profile. The profile's own checks come first: a refused restart leaves the running engine alone. 423 naming
        the holder while a run, a switch or the watch holds the engine."""
        with slot.holding(f"{request.user.name}'s restart"):
            slot.supervisor.restart(request.user.name, data.profile if data else None)
        return service.engine_status(db_session, slot, checkpoint)

    @get("/runs", operation_id="listEngineRuns", sync_to_thread=True)
    def list_runs(
        self, db_session: NamedDependency[Session], limit: Annotated[int, QueryParameter(ge=1, le=1000)] = 50
    ) -> list[RunRead]:
        """Every start of the engine, newest first: profile, content hash, weights fingerprint, times, exit code,
        state and log path."""
        return service.list_runs(db_session, limit)

    @get("/logs", operation_id="getEngineLogs", sync_to_thread=True)
    def logs(
        self,
        db_session: NamedDependency[Session],
        run: FromQuery[int | None] = None,
        lines: Annotated[int, QueryParameter(ge=1, le=10_000)] = 200,
    ) -> LogTail:
        """The last `lines` of a run's log (by default the latest run's)."""
        return service.log_tail(db_session, run, lines)
