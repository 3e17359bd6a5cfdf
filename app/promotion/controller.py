"""`/api/route`: who holds the production and rollback roles, the switch transactions, and
`/api/profiles/{name}/decisions`: an operator's decision on a run's evidence."""

from __future__ import annotations

from litestar import Controller, Request, Response, get, post, put
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.exceptions import NotFoundException
from litestar.openapi import ResponseSpec
from litestar.params import FromPath, JSONBody
from litestar.status_codes import HTTP_200_OK, HTTP_201_CREATED, HTTP_202_ACCEPTED
from sqlmodel import Session, col, select

from app.auth.guards import requires_operator, requires_viewer
from app.engine_control.slot import Locked
from app.errors import Conflict, InvalidFields
from app.profiles.controller import provide_profile_service
from app.profiles.models import Profile
from app.profiles.roles import route_row
from app.profiles.schemas import ProfileRead
from app.profiles.service import ProfileService, profile_named
from app.promotion.decisions import Promoter
from app.promotion.models import Promotion, PromotionKind
from app.promotion.schemas import PlanRead, PromotionRead, PromotionRequest, RollbackRequest, RouteRead
from app.promotion.switch import promotions_by_decision, read_promotion
from app.qualification.schemas import DecisionCreate, DecisionRead
from app.qualification.service import decisions_for


def provide_promoter(state: State) -> Promoter:
    return state.promoter


PROMOTER = {"promoter": Provide(provide_promoter, sync_to_thread=False)}
REFUSED = [InvalidFields, Conflict, Locked]


def switch_responses(what: str) -> dict[int, ResponseSpec]:
    """A switch answers 202 with the switch to poll, or 200 with the plan for `dry_run: true`."""
    return {
        HTTP_202_ACCEPTED: ResponseSpec(
            PromotionRead, description=f"{what} started: poll GET /api/route/promotions/{{id}} until it ends"
        ),
        HTTP_200_OK: ResponseSpec(PlanRead, description="dry_run: what would stop and start, and what refuses it"),
    }


def get_promotion(session: Session, promotion_id: int) -> PromotionRead:
    promotion = session.get(Promotion, promotion_id)
    if promotion is None:
        raise NotFoundException(f"no promotion with id {promotion_id}")
    return read_promotion(session, promotion)


class RouteController(Controller):
    path = "/api/route"
    tags = ["promotion"]
    guards = [requires_viewer]
    dependencies = PROMOTER

    @get("/", operation_id="getRoute", sync_to_thread=True)
    def route(self, db_session: NamedDependency[Session], promoter: NamedDependency[Promoter]) -> RouteRead:
        """Production, the rollback profile with whether it can start now, challengers, rejected profiles, the
        switch running now and the latest ones."""
        return promoter.route(db_session)

    @get(
        "/production",
        operation_id="getProductionProfile",
        sync_to_thread=True,
        dependencies={"profiles": Provide(provide_profile_service, sync_to_thread=False)},
    )
    def production(
        self, db_session: NamedDependency[Session], profiles: NamedDependency[ProfileService]
    ) -> ProfileRead | None:
        """The profile serving the agent route, or null when none has been promoted."""
        route = route_row(db_session)
        if route is None or route.production_id is None:
            return None
        return profiles.read_one(db_session.get(Profile, route.production_id).name)

    @put(
        "/production",
        guards=[requires_operator],
        operation_id="promoteProfile",
        status_code=HTTP_202_ACCEPTED,
        responses=switch_responses("the switch"),
        raises=REFUSED,
        sync_to_thread=True,
    )
    def promote(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        promoter: NamedDependency[Promoter],
        data: JSONBody[PromotionRequest],
    ) -> Response[PromotionRead | PlanRead]:
        """Switch production to an approved profile (a `promote` decision on a current run of its exact content):
        drain and stop what serves, start it, wait for ready, smoke it, commit — or restore what served. Answers
        202 with the switch to poll. With `dry_run: true`, 200 with the plan: what stops, what starts, the rollback
        target and whether each can start now, and what would refuse it. 409 with the reason for an unqualified,
        stale or unapproved target; 423 while a transaction runs."""
        if data.dry_run:
            profile = profile_named(db_session, data.profile)
            refusals = promoter.target_refusals(db_session, profile)
            plan = promoter.plan(db_session, PromotionKind.promote, profile, refusals)
            return Response(plan, status_code=HTTP_200_OK)
        promotion_id = promoter.promote(request.user.name, data.profile, data.reason)
        return Response(get_promotion(db_session, promotion_id), status_code=HTTP_202_ACCEPTED)

    @post(
        "/rollback",
        guards=[requires_operator],
        operation_id="rollBack",
        status_code=HTTP_202_ACCEPTED,
        responses=switch_responses("the rollback"),
        raises=REFUSED,
        sync_to_thread=True,
    )
    def rollback(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        promoter: NamedDependency[Promoter],
        data: JSONBody[RollbackRequest],
    ) -> Response[PromotionRead | PlanRead]:
        """The same transaction back to the last known good (the rollback role); 202 with the switch, or 200 with
        the plan for `dry_run: true`. 409 when there is no rollback profile or its evidence is stale; 423 while a
        transaction runs."""
        if data.dry_run:
            profile = promoter.rollback_target(db_session)
            refusals = promoter.target_refusals(db_session, profile)
            plan = promoter.plan(db_session, PromotionKind.rollback, profile, refusals)
            return Response(plan, status_code=HTTP_200_OK)
        promotion_id = promoter.rollback(request.user.name, data.reason)
        return Response(get_promotion(db_session, promotion_id), status_code=HTTP_202_ACCEPTED)

    @get("/promotions", operation_id="listPromotions", sync_to_thread=True)
    def promotions(self, db_session: NamedDependency[Session]) -> list[PromotionRead]:
        """Every switch, newest first, with its steps."""
        rows = db_session.exec(select(Promotion).order_by(col(Promotion.id).desc()).limit(100)).all()
        return [read_promotion(db_session, p) for p in rows]

    @get("/promotions/{promotion_id:int}", operation_id="getPromotion", sync_to_thread=True)
    def promotion(self, db_session: NamedDependency[Session], promotion_id: FromPath[int]) -> PromotionRead:
        """One switch: its steps (drain, stop, start, smoke, commit or restore), status, downtime and error."""
        return get_promotion(db_session, promotion_id)


class DecisionController(Controller):
    path = "/api/profiles/{name:str}/decisions"
    tags = ["promotion"]
    guards = [requires_viewer]
    dependencies = PROMOTER

    @post(
        "/",
        guards=[requires_operator],
        operation_id="decide",
        status_code=HTTP_201_CREATED,
        raises=REFUSED,
        sync_to_thread=True,
    )
    def decide(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        promoter: NamedDependency[Promoter],
        name: FromPath[str],
        data: JSONBody[DecisionCreate],
    ) -> DecisionRead:
        """Decide on a run (by default the profile's latest finished one): `promote`, `no_promotion` or `reject`,
        with a `reason`. A promotion needs `confirm` to be the profile's name and a waiver (`gate`, `reason`) for
        each failed gate, and starts the switch (`promotion` is its id). 422 naming the field; 409 for an
        unqualified, stale or aborted run; 423 while a transaction runs."""
        decision_id, _ = promoter.decide(request.user.name, name, data)
        profile = profile_named(db_session, name)
        return next(d for d in decisions_for(db_session, profile.id, promotions_by_decision) if d.id == decision_id)

    @get("/", operation_id="listDecisions", sync_to_thread=True)
    def decisions(
        self, db_session: NamedDependency[Session], promoter: NamedDependency[Promoter], name: FromPath[str]
    ) -> list[DecisionRead]:
        """The profile's decisions, newest first, with their waivers."""
        profile = profile_named(db_session, name)
        return decisions_for(db_session, profile.id, promotions_by_decision)
