"""The route page: who holds production and rollback (and whether the rollback can start now), challengers and
rejected profiles, the switch running now (polled live), a dry run of any switch, and the rollback. And the decision
form on a qualification run's page, since a promote decision starts a switch."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, FromQuery, URLEncodedBody
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from litestar.status_codes import HTTP_200_OK
from sqlmodel import Session, col, select

from app.audit.alerts import alerts
from app.auth.guards import requires_operator, requires_viewer
from app.console import redirect
from app.engine_control.slot import Locked
from app.errors import Conflict, FieldError, InvalidFields
from app.profiles.models import Profile
from app.profiles.service import profile_named
from app.promotion.controller import provide_promoter
from app.promotion.decisions import Promoter
from app.promotion.models import PromotionKind
from app.promotion.schemas import PlanRead
from app.qualification import service as qualification
from app.qualification.controller import provide_qualifier
from app.qualification.ladder import Qualifier
from app.qualification.pages import run_context
from app.qualification.schemas import DecisionCreate, QualificationRead, WaiverCreate

ROUTE = "/route"


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


class RoutePages(Controller):
    guards = [requires_viewer]
    dependencies = {"promoter": Provide(provide_promoter, sync_to_thread=False)}

    @staticmethod
    def _context(session: Session, promoter: Promoter, plan: PlanRead | None = None) -> dict[str, Any]:
        names = session.exec(select(Profile.name).where(col(Profile.retired).is_(False)).order_by(Profile.name)).all()
        return {"route": promoter.route(session), "profiles": names, "plan": plan, "alerts": alerts(session)}

    @get(ROUTE, sync_to_thread=True)
    def route_page(
        self,
        db_session: NamedDependency[Session],
        promoter: NamedDependency[Promoter],
        plan: FromQuery[str | None] = None,
    ) -> Template:
        dry_run = self._plan(db_session, promoter, plan) if plan else None
        return Template("promotion/route.html", context=self._context(db_session, promoter, dry_run))

    @get(f"{ROUTE}/live", sync_to_thread=True)
    def live(self, db_session: NamedDependency[Session], promoter: NamedDependency[Promoter]) -> Template:
        return Template("promotion/_live.html", context=self._context(db_session, promoter))

    @get(f"{ROUTE}/plan", sync_to_thread=True)
    def plan_partial(
        self, db_session: NamedDependency[Session], promoter: NamedDependency[Promoter], plan: FromQuery[str]
    ) -> Template:
        return Template("promotion/_plan.html", context={"plan": self._plan(db_session, promoter, plan)})

    @staticmethod
    def _plan(session: Session, promoter: Promoter, name: str) -> PlanRead:
        profile = profile_named(session, name)
        return promoter.plan(session, PromotionKind.promote, profile, promoter.target_refusals(session, profile))

    @post(f"{ROUTE}/production", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def promote(
        self, request: HTMXRequest, promoter: NamedDependency[Promoter], data: URLEncodedBody[dict[str, str]]
    ) -> Response:
        promoter.promote(request.user.name, data.get("profile", ""), data.get("reason", ""))
        return redirect(request, ROUTE)

    @post(f"{ROUTE}/rollback", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def rollback(
        self, request: HTMXRequest, promoter: NamedDependency[Promoter], data: URLEncodedBody[dict[str, str]]
    ) -> Response:
        promoter.rollback(request.user.name, data.get("reason", ""))
        return redirect(request, ROUTE)


class DecisionPages(Controller):
    """The decision form on a qualification run's page: an operator's decision, and a promotion's switch."""

    guards = [requires_viewer]
    dependencies = {
        "qualifier": Provide(provide_qualifier, sync_to_thread=False),
        "promoter": Provide(provide_promoter, sync_to_thread=False),
    }

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
        run = qualification.read_run(db_session, run_id, qualifier.reading)
        decision, waived = decision_request(data, run)
        try:
            _, promotion = promoter.decide(request.user.name, run.profile, decision)
        except (InvalidFields, Conflict, Locked) as exc:
            # The form again, where the operator is looking: every field error beside its input, or the refusal
            # beside the button with each failed gate that lacks a waiver marked; nothing from the last try stays.
            if isinstance(exc, InvalidFields):
                extra = {"errors": form_errors(exc.errors, waived)}
            else:
                unwaived = [g.name for g in run.gates if g.status == "failed" and g.name not in waived]
                extra = {"refusal": exc.detail, "unwaived": unwaived if decision.decision == "promote" else []}
            context = run_context(db_session, qualifier, run_id, values=data, **extra)
            template = "qualification/_decision.html" if request.htmx else "qualification/run.html"
            return Template(template, context=context, status_code=exc.status_code)
        return redirect(request, "/route" if promotion else f"/qualifications/{run_id}")
