"""`/api/route/production`: which profile holds the production role. Promotion needs qualification evidence, which
the qualification issue brings; until then nothing can hold the role and a promotion is refused with the reason."""

from __future__ import annotations

from litestar import Controller, get, put
from litestar.params import JSONBody

from app.auth.guards import requires_operator, requires_viewer
from app.errors import Conflict
from app.profiles.schemas import ProfileRead
from app.promotion.schemas import PromotionRequest


class RouteController(Controller):
    path = "/api/route/production"
    tags = ["promotion"]

    @get("/", guards=[requires_viewer], operation_id="getProductionProfile", sync_to_thread=False)
    def production(self) -> ProfileRead | None:
        """The profile serving the agent route, or null when none has been promoted."""
        return None

    @put("/", guards=[requires_operator], operation_id="promoteProfile", sync_to_thread=False)
    def promote(self, data: JSONBody[PromotionRequest]) -> ProfileRead:
        """Promote a profile to production (409 until promotion rules exist: qualification comes first)."""
        raise Conflict(
            f"cannot promote {data.profile!r}: promotion rules are not implemented yet: qualification is required"
        )
