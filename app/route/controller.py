"""The agent route (`/v1/*`, agent keys only), agent keys (`/api/keys`), and the route's client configuration,
metrics and alerts (`/api/route/...`, operator tokens only)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from litestar import Controller, MediaType, Request, Response, delete, get, post
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.params import FromPath, JSONBody, QueryParameter
from litestar.response import Stream
from litestar.status_codes import HTTP_201_CREATED, HTTP_204_NO_CONTENT
from sqlmodel import Session

from app.audit import alerts as audit_alerts
from app.audit.schemas import AlertRead
from app.auth.guards import requires_operator, requires_viewer
from app.route import service
from app.route.client_config import client_config
from app.route.proxy import MODELS, AgentRoute, Body, RouteError
from app.route.schemas import ClientConfigRead, IssuedKey, KeyCreate, KeyRead, MetricsRead
from app.settings import Settings

# An agent's whole conversation travels in each request (the engine takes the same); the route refuses far less
# for a given profile, from its context length (proxy.body_limit).
MAX_BODY_BYTES = 256 << 20


def provide_route(state: State) -> AgentRoute:
    return state.route


ROUTE = {"route": Provide(provide_route, sync_to_thread=False)}


def route_error(_: Request, error: RouteError) -> Response:
    return Response(error.body(), status_code=error.status_code, headers=error.headers, media_type=MediaType.JSON)


async def _answer(route: AgentRoute, request: Request, endpoint: str) -> Response | Stream:
    body = b""
    if request.method == "POST":
        declared = request.headers.get("content-length")
        body = Body(request.stream(), int(declared) if declared and declared.isdigit() else None)
    answer = await route.serve(request.headers.get("authorization"), request.method, endpoint, body)
    headers = dict(answer.headers)
    # Litestar adds the charset to a text/* type itself; the engine's own would make it appear twice.
    media_type = headers.pop("content-type").split(";")[0]
    if answer.stream is not None:
        return Stream(answer.stream, status_code=answer.status, headers=headers, media_type=media_type)
    return Response(answer.body, status_code=answer.status, headers=headers, media_type=media_type)


class AgentController(Controller):
    """The OpenAI-compatible API agents call with an agent key (`Authorization: Bearer fg-…`), whichever profile
    serves. 401 without a live key; 503 with `Retry-After` while no production engine is ready (a switch, a
    restart); a budget over the production profile's `max_output_tokens` is clamped, with a `Warning` header."""

    path = "/v1"
    tags = ["agent route"]
    dependencies = ROUTE
    exception_handlers = {RouteError: route_error}
    request_max_body_size = MAX_BODY_BYTES
    security = [{"agentKey": []}]

    @get("/models", operation_id="listRouteModels")
    async def models(self, request: Request, route: NamedDependency[AgentRoute]) -> Response:
        """The route's one model: the served-model alias, its context window and output limit."""
        return await _answer(route, request, MODELS)

    @post("/chat/completions", operation_id="routeChatCompletions")
    async def chat_completions(self, request: Request, route: NamedDependency[AgentRoute]) -> Response | Stream:
        """Chat completions, whole or streamed (SSE ending in `data: [DONE]`)."""
        return await _answer(route, request, "/v1/chat/completions")

    @post("/completions", operation_id="routeCompletions")
    async def completions(self, request: Request, route: NamedDependency[AgentRoute]) -> Response | Stream:
        """Text completions, whole or streamed."""
        return await _answer(route, request, "/v1/completions")

    @post("/responses", operation_id="routeResponses")
    async def responses(self, request: Request, route: NamedDependency[AgentRoute]) -> Response | Stream:
        """The Responses API's stateless subset, whole or streamed."""
        return await _answer(route, request, "/v1/responses")


class KeyController(Controller):
    path = "/api/keys"
    tags = ["agent route"]
    guards = [requires_viewer]
    dependencies = ROUTE

    @post("/", guards=[requires_operator], operation_id="createKey", status_code=HTTP_201_CREATED, sync_to_thread=True)
    def create(self, request: Request, db_session: NamedDependency[Session], data: JSONBody[KeyCreate]) -> IssuedKey:
        """Make an agent key with a name; the key (`fg-…`) is in this response only. 409 while a live key has the
        name."""
        key, secret = service.create_key(db_session, request.user.name, data.name)
        return IssuedKey(**msgspec.structs.asdict(service.read_key(key, {})), key=secret)

    @get("/", operation_id="listKeys", sync_to_thread=True)
    def list_keys(self, db_session: NamedDependency[Session], route: NamedDependency[AgentRoute]) -> list[KeyRead]:
        """Every agent key (never the secrets): live ones first, with requests, errors and last use."""
        route.usage.flush()
        return service.list_keys(db_session)

    @delete(
        "/{name:str}",
        guards=[requires_operator],
        operation_id="revokeKey",
        status_code=HTTP_204_NO_CONTENT,
        sync_to_thread=True,
    )
    def revoke(self, request: Request, db_session: NamedDependency[Session], name: FromPath[str]) -> None:
        """Revoke the live key with this name; it stops working at once."""
        service.revoke_key(db_session, request.user.name, name)


class RouteApiController(Controller):
    path = "/api/route"
    tags = ["agent route"]
    guards = [requires_viewer]
    dependencies = ROUTE

    @get("/client-config", operation_id="getClientConfig", sync_to_thread=True)
    def client_config(
        self,
        request: Request,
        db_session: NamedDependency[Session],
        client: Annotated[Literal["pi", "openai"], QueryParameter()] = "pi",
    ) -> ClientConfigRead:
        """A client's configuration for the route from the production profile and its engine's /server_info: Pi's
        `models.json` (`client=pi`) or an OpenAI client snippet (`client=openai`). 409 before any promotion."""
        settings: Settings = request.app.state.settings
        return client_config(db_session, client, settings.route_alias, route_base_url(request, settings))

    @get("/metrics", operation_id="getRouteMetrics", sync_to_thread=True)
    def metrics(self, db_session: NamedDependency[Session], route: NamedDependency[AgentRoute]) -> MetricsRead:
        """Requests, errors and latency through the route, per key (and the console's own callers) and per
        profile."""
        route.usage.flush()
        by_key, by_profile = service.usage(db_session)
        return MetricsRead(alias=route.alias, by_key=by_key, by_profile=by_profile)

    @get("/alerts", operation_id="listAlerts", sync_to_thread=True)
    def alerts(
        self, db_session: NamedDependency[Session], all: Annotated[bool, QueryParameter()] = False
    ) -> list[AlertRead]:
        """The production watch's alerts, newest first: open ones, or with `all=true` acknowledged ones too."""
        return audit_alerts.alerts(db_session, include_acknowledged=all)

    @post(
        "/alerts/{alert_id:int}/acknowledge",
        guards=[requires_operator],
        operation_id="acknowledgeAlert",
        status_code=200,
        sync_to_thread=True,
    )
    def acknowledge(self, request: Request, db_session: NamedDependency[Session], alert_id: FromPath[int]) -> AlertRead:
        """Mark an alert as seen; it leaves the console's banners."""
        return audit_alerts.acknowledge(db_session, request.user.name, alert_id)


def route_base_url(request: Request, settings: Settings) -> str:
    """Where clients reach the route: FLASHGATE_PUBLIC_URL, else the URL the operator reached the console at."""
    return f"{settings.public_url or str(request.base_url).rstrip('/')}/v1"
