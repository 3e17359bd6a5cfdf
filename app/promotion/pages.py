"""The route page: who holds production and rollback (and whether the rollback can start now), challengers and
rejected profiles, the switch running now (polled live), a dry run of any switch, and the rollback."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Response, get, post
from litestar.di import NamedDependency, Provide
from litestar.params import FromQuery, URLEncodedBody
from litestar.plugins.htmx import HTMXRequest
from litestar.response import Template
from litestar.status_codes import HTTP_200_OK
from sqlmodel import Session, col, select

from app.auth.guards import requires_operator, requires_viewer
from app.console import redirect
from app.profiles.models import Profile
from app.profiles.service import ProfileService
from app.promotion.controller import provide_promoter
from app.promotion.models import PromotionKind
from app.promotion.schemas import PlanRead
from app.promotion.service import Promoter
from app.route.service import alerts

ROUTE = "/route"


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
        profile = ProfileService(session, promoter.settings.models_dir).get(name)
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
