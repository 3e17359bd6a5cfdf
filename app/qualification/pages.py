"""Console pages for qualification: start a run from a profile, watch it live (one partial htmx polls while the run
goes on), read the proposal, decide; the readable report with its performance plot; the evidence bundle as a file."""

from __future__ import annotations

import json
from typing import Any

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, URLEncodedBody
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from litestar.status_codes import HTTP_200_OK
from sqlmodel import Session

from app.auth.guards import requires_operator, requires_viewer
from app.console import redirect
from app.qualification import service
from app.qualification.controller import provide_qualifier
from app.qualification.gates import GATES
from app.qualification.ladder import Qualifier
from app.qualification.plot import performance_charts
from app.qualification.schemas import QualificationRead

RECOMMENDATION_LABELS = {
    "promote": "Promote",
    "no_promotion": "No promotion",
    "reject": "Reject",
    "requalify": "Requalify",
    "pending": "Pending",
    "none": "No proposal",
}


def run_context(session: Session, qualifier: Qualifier, run_id: int, **extra: Any) -> dict[str, Any]:
    """What a run's page shows; `extra` holds the decision form's values, its field errors or the refusal, and the
    failed gates without a waiver, when it comes back refused."""
    run = service.read_run(session, run_id, qualifier.reading)
    return {
        "run": run,
        "labels": RECOMMENDATION_LABELS,
        "values": {},
        "errors": {},
        "refusal": None,
        "unwaived": [],
        **extra,
    }


class QualificationPages(Controller):
    guards = [requires_viewer]
    dependencies = {"qualifier": Provide(provide_qualifier, sync_to_thread=False)}

    @get("/qualifications/{run_id:int}", sync_to_thread=True)
    def run_page(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        return Template("qualification/run.html", context=run_context(db_session, qualifier, run_id))

    @get("/qualifications/{run_id:int}/live", sync_to_thread=True)
    def live(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        return Template("qualification/_live.html", context=run_context(db_session, qualifier, run_id))

    @get("/qualifications/{run_id:int}/report", sync_to_thread=True)
    def report(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        context = run_context(db_session, qualifier, run_id)
        run: QualificationRead = context["run"]
        comparison = run.proposal.comparison
        theirs = service.performance_measurements(db_session, comparison.run) if comparison.run else None
        mine = service.performance_measurements(db_session, run_id)
        context |= {
            "charts": performance_charts(mine, theirs, comparison.against if theirs else None),
            "observations": service.observations(db_session, run_id),
            "definitions": {name: gate.definition() for name, gate in GATES.items()},
        }
        return Template("qualification/report.html", context=context)

    @get("/qualifications/{run_id:int}/evidence.json", sync_to_thread=True)
    def evidence_file(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Response:
        bundle = service.bundle(db_session, run_id, qualifier.reading)
        return Response(
            json.dumps(bundle, indent=1),
            media_type="application/json",
            headers={"Content-Disposition": f'attachment; filename="qualification-{run_id}-evidence.json"'},
        )

    @post(
        "/profiles/{name:str}/qualifications", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True
    )
    def qualify(
        self,
        request: HTMXRequest,
        qualifier: NamedDependency[Qualifier],
        name: FromPath[str],
        data: URLEncodedBody[dict[str, str]],
    ) -> Response:
        run_id = qualifier.start(request.user.name, name, data.get("confirm_downtime") == "on")
        return redirect(request, f"/qualifications/{run_id}")
