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
from app.errors import FieldError, InvalidFields
from app.promotion.controller import provide_promoter
from app.promotion.schemas import DecisionCreate, WaiverCreate
from app.promotion.service import Promoter
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
}


def decision_request(form: dict[str, str], run: QualificationRead) -> tuple[DecisionCreate, list[str]]:
    """The decision form as the API's request: a checked `waive.<gate>` with its `waiver_reason.<gate>` is a waiver.
    Returns the request and the waived gates in order, to put each error beside its gate."""
    failed = [g.name for g in run.gates if g.status == "failed"]
    waived = [gate for gate in failed if form.get(f"waive.{gate}")]
    return (
        DecisionCreate(
            decision=form.get("decision", ""),
            reason=form.get("reason", ""),
            confirm=form.get("confirm", ""),
            waivers=[WaiverCreate(gate=gate, reason=form.get(f"waiver_reason.{gate}", "")) for gate in waived],
            run=run.id,
        ),
        waived,
    )


def form_errors(errors: list[FieldError], waived: list[str]) -> dict[str, str]:
    """Errors by form field: `waivers[i].reason` belongs to the i-th waived gate's reason input."""
    shown = {}
    for error in errors:
        field = error.field
        if field.startswith("waivers[") and "]" in field:
            index = int(field[len("waivers[") : field.index("]")])
            field = f"waiver_reason.{waived[index]}" if index < len(waived) else "waivers"
        shown[field] = error.message
    return shown


class QualificationPages(Controller):
    guards = [requires_viewer]
    dependencies = {
        "qualifier": Provide(provide_qualifier, sync_to_thread=False),
        "promoter": Provide(provide_promoter, sync_to_thread=False),
    }

    @staticmethod
    def _context(session: Session, qualifier: Qualifier, run_id: int, **extra: Any) -> dict[str, Any]:
        run = service.read_run(session, run_id, qualifier.settings.models_dir)
        return {
            "run": run,
            "labels": RECOMMENDATION_LABELS,
            "values": {},
            "errors": {},
            **extra,
        }

    @get("/qualifications/{run_id:int}", sync_to_thread=True)
    def run_page(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        return Template("qualification/run.html", context=self._context(db_session, qualifier, run_id))

    @get("/qualifications/{run_id:int}/live", sync_to_thread=True)
    def live(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        return Template("qualification/_live.html", context=self._context(db_session, qualifier, run_id))

    @get("/qualifications/{run_id:int}/report", sync_to_thread=True)
    def report(
        self, db_session: NamedDependency[Session], qualifier: NamedDependency[Qualifier], run_id: FromPath[int]
    ) -> Template:
        context = self._context(db_session, qualifier, run_id)
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
        bundle = service.bundle(db_session, run_id, qualifier.settings.models_dir)
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

    @post(
        "/qualifications/{run_id:int}/decisions",
        guards=[requires_operator],
        status_code=HTTP_200_OK,
        sync_to_thread=True,
    )
    def decide(
        self,
        request: HTMXRequest,
        db_session: NamedDependency[Session],
        qualifier: NamedDependency[Qualifier],
        promoter: NamedDependency[Promoter],
        run_id: FromPath[int],
        data: URLEncodedBody[dict[str, str]],
    ) -> Response:
        run = service.read_run(db_session, run_id, qualifier.settings.models_dir)
        decision, waived = decision_request(data, run)
        try:
            _, promotion = promoter.decide(request.user.name, run.profile, decision)
        except InvalidFields as exc:
            # The form again with every error beside its input; a 409 or 423 shows as the page's notice instead.
            context = self._context(db_session, qualifier, run_id, values=data, errors=form_errors(exc.errors, waived))
            template = "qualification/_decision.html" if request.htmx else "qualification/run.html"
            return Template(template, context=context, status_code=exc.status_code)
        return redirect(request, "/route" if promotion else f"/qualifications/{run_id}")
