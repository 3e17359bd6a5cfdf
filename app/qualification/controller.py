"""`/api/gates`, `/api/profiles/{name}/qualifications`, `/api/qualifications/{id}`: the ladder's definitions, runs
with their live progress and per-gate results, and the evidence bundle."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_202_ACCEPTED
from sqlmodel import Session

from app.auth.guards import requires_operator, requires_viewer
from app.engine_control.slot import Locked
from app.errors import Conflict
from app.profiles.service import profile_named
from app.qualification import service
from app.qualification.gates import LADDER
from app.qualification.ladder import Qualifier
from app.qualification.schemas import GateDefinitionRead, QualificationRead, QualifyRequest


def provide_qualifier(state: State) -> Qualifier:
    return state.qualifier


class QualificationController(Controller):
    path = "/api"
    tags = ["qualification"]
    guards = [requires_viewer]
    dependencies = {"qualifier": Provide(provide_qualifier, sync_to_thread=False)}

    @get("/gates", operation_id="listGates", sync_to_thread=False)
    def gates(self) -> list[GateDefinitionRead]:
        """The ladder in order: each gate's name, version, pass rule and measurements."""
        return [GateDefinitionRead(**gate.definition()) for gate in LADDER]

    @post(
        "/profiles/{name:str}/qualifications",
        guards=[requires_operator],
        operation_id="startQualification",
        status_code=HTTP_202_ACCEPTED,
        raises=[Conflict, Locked],
        sync_to_thread=True,
    )
    def start(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        qualifier: NamedDependency[Qualifier],
        name: FromPath[str],
        data: JSONBody[QualifyRequest | None] = None,
    ) -> QualificationRead:
        """Start the engine with the profile and run the ladder in the background; answers at once with the run
        (`id`, `status`). 409 with the reason when the profile cannot start, or when an engine is serving and
        `confirm_downtime` is not true (the run drains, stops and later restores it); 423 while another run or a
        switch holds the engine."""
        run_id = qualifier.start(request.user.name, name, bool(data and data.confirm_downtime))
        return service.read_run(db_session, run_id, qualifier.reading)

    @get("/profiles/{name:str}/qualifications", operation_id="listQualifications", sync_to_thread=True)
    def list_runs(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], name: FromPath[str]
    ) -> list[QualificationRead]:
        """The profile's runs, newest first."""
        profile = profile_named(db_session, name)
        return service.list_runs(db_session, profile.id, qualifier.reading)

    @get("/qualifications/{run_id:int}", operation_id="getQualification", sync_to_thread=True)
    def get_run(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> QualificationRead:
        """A run: `status` (waiting, starting, running, passed, failed, aborted), `progress` (the gate running,
        its step, elapsed seconds), per-gate results with inputs, pass rule, measurements and waivers, whether the
        evidence is stale, the console's proposal (with deltas against production on the same shape), and the
        decisions taken on it."""
        return service.read_run(db_session, run_id, qualifier.reading)

    @get("/qualifications/{run_id:int}/evidence", operation_id="getQualificationEvidence", sync_to_thread=True)
    def evidence(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> dict[str, Any]:
        """The evidence bundle: the run, the gate definitions, every observation (request, response excerpt, timings,
        usage), and the engine run with the end of its log."""
        return service.bundle(db_session, run_id, qualifier.reading)
