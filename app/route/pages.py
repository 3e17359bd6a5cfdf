"""The Agents page (agent keys, client configuration with a copy button, route metrics) and the production watch's
alerts, which the dashboard, the route page and the Agents page show."""

from __future__ import annotations

from litestar import Controller, Request, get, post
from litestar.di import NamedDependency
from litestar.exceptions import HTTPException
from litestar.params import FromPath, URLEncodedBody
from litestar.response import Template
from litestar.status_codes import HTTP_200_OK
from sqlmodel import Session

from app.audit.alerts import acknowledge, alerts
from app.auth.guards import requires_operator, requires_viewer
from app.route import service
from app.route.client_config import CLIENTS, client_config
from app.route.controller import route_base_url
from app.settings import Settings

AGENTS = "/route/agents"
ALERTS = "/route/alerts"


class AgentPages(Controller):
    guards = [requires_viewer]

    @get(AGENTS, sync_to_thread=True)
    def agents(self, request: Request, db_session: NamedDependency[Session]) -> Template:
        settings: Settings = request.app.state.settings
        request.app.state.route.usage.flush()
        base_url = route_base_url(request, settings)
        configs, unavailable = {}, None
        try:
            configs = {c: client_config(db_session, c, settings.route_alias, base_url) for c in CLIENTS}
        except HTTPException as exc:
            unavailable = exc.detail
        by_key, by_profile = service.usage(db_session)
        context = {
            "alias": settings.route_alias,
            "base_url": base_url,
            "configs": configs,
            "unavailable": unavailable,
            "keys": service.list_keys(db_session),
            "issued": None,
            "error": None,
            "name": "",
            "by_key": by_key,
            "by_profile": by_profile,
            "alerts": alerts(db_session),
        }
        return Template("route/agents.html", context=context)

    @post(f"{AGENTS}/keys", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True)
    def create_key(
        self, request: Request, db_session: NamedDependency[Session], data: URLEncodedBody[dict[str, str]]
    ) -> Template:
        """The keys section again, with the new key shown this once (or the form with its error)."""
        name = data.get("name", "").strip()
        try:
            key, secret = service.create_key(db_session, request.user.name, name)
        except HTTPException as exc:
            context = {"keys": service.list_keys(db_session), "issued": None, "error": exc.detail, "name": name}
            return Template("route/_keys.html", context=context, status_code=exc.status_code)
        context = {"keys": service.list_keys(db_session), "issued": {"name": key.name, "key": secret}}
        return Template("route/_keys.html", context=context | {"error": None, "name": ""})

    @post(
        f"{AGENTS}/keys/{{name:str}}/revoke", guards=[requires_operator], status_code=HTTP_200_OK, sync_to_thread=True
    )
    def revoke_key(self, request: Request, db_session: NamedDependency[Session], name: FromPath[str]) -> Template:
        service.revoke_key(db_session, request.user.name, name)
        context = {"keys": service.list_keys(db_session), "issued": None, "error": None, "name": ""}
        return Template("route/_keys.html", context=context)

    @get(ALERTS, sync_to_thread=True)
    def alerts(self, db_session: NamedDependency[Session]) -> Template:
        return Template("route/_alerts.html", context={"alerts": alerts(db_session)})

    @post(
        f"{ALERTS}/{{alert_id:int}}/acknowledge",
        guards=[requires_operator],
        status_code=HTTP_200_OK,
        sync_to_thread=True,
    )
    def acknowledge(self, request: Request, db_session: NamedDependency[Session], alert_id: FromPath[int]) -> Template:
        acknowledge(db_session, request.user.name, alert_id)
        return Template("route/_alerts.html", context={"alerts": alerts(db_session)})
