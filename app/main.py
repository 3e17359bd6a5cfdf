"""The console's Litestar application: the database, the REST API under /api, and the server-rendered pages."""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import structlog
from litestar import Litestar, Response, Router, get, head
from litestar.config.csrf import CSRFConfig
from litestar.datastructures import ResponseHeader, State
from litestar.di import Provide
from litestar.exceptions import HTTPException, NotFoundException, ServiceUnavailableException
from litestar.exceptions.responses import create_exception_response
from litestar.openapi.config import OpenAPIConfig
from litestar.openapi.spec import Components, SecurityScheme
from litestar.plugins.htmx import HTMXPlugin, HTMXRequest
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.static_files import create_static_files_router
from litestar.template.config import TemplateConfig
from litestar.types import Scope
from sqlalchemy import Engine, text
from sqlalchemy.exc import SQLAlchemyError
from sqlmodel import Session

from app.audit.controller import AuditController
from app.audit.pages import AuditPages
from app.auth.controller import OperatorController
from app.auth.guards import requires_viewer
from app.auth.middleware import API_PREFIX, ROUTE_PREFIX, AuthenticationMiddleware, security_headers
from app.auth.pages import SignInController
from app.auth.service import CSRF_SECRET, ENV_ADMIN, appliance_secret, bootstrap_admin
from app.auth.throttle import AttemptLimit
from app.console import console_error, console_router
from app.db import create_db_engine, migrate, session_provider
from app.engine_control.checkpoint import DemoCheckpoint
from app.engine_control.controller import EngineController
from app.engine_control.docker_driver import DockerDriver
from app.engine_control.driver import EngineDriver
from app.engine_control.pages import DashboardPages
from app.engine_control.preflight import host_gpus
from app.engine_control.process_driver import ProcessDriver
from app.engine_control.slot import EngineSlot
from app.engine_control.supervisor import Supervisor
from app.logging import RequestLogMiddleware
from app.profiles.controller import ProfileController
from app.profiles.engine_options import warm_engine_options
from app.profiles.pages import ProfilePages
from app.profiles.schemas import HostGpus
from app.profiles.service import ProfileFacts, ProfileService
from app.promotion.controller import DecisionController, RouteController
from app.promotion.decisions import Promoter
from app.promotion.pages import DecisionPages, RoutePages
from app.promotion.roles import roles_by_profile
from app.promotion.switch import Switch, promotions_by_decision
from app.qualification.controller import QualificationController
from app.qualification.evidence import evidence_count
from app.qualification.ladder import Qualifier
from app.qualification.pages import QualificationPages
from app.qualification.service import RunReading, profile_page
from app.qualification.settings import load_qualification_settings
from app.route.controller import AgentController, KeyController, RouteApiController
from app.route.pages import AgentPages
from app.route.proxy import AgentRoute
from app.route.smoke import route_smoke
from app.route.watch import ProductionWatch
from app.settings import Settings, load_settings
from app.telemetry.controller import TelemetryController
from app.telemetry.gpus import Gpus, NvmlGpus
from app.telemetry.service import Telemetry

log = structlog.get_logger(__name__)

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES_DIR = ROOT / "console" / "templates"
STATIC_DIR = ROOT / "console" / "static"
SEED_DIR = ROOT / "profiles"
# The demo model the project ships (engine/tools/ship_demo.py writes it); cpu-demo serves its installed copy.
DEMO_MODEL_DIR = ROOT / "engine" / "demo_model"
BUILD_HEADER = "X-Flashgate-Build"


def run_reading(settings: Settings) -> RunReading:
    return RunReading(settings.models_dir, promotions_by_decision)


def profile_facts(settings: Settings, gpus: Gpus | None = None) -> ProfileFacts:
    """What the domains above profiles tell them (profiles import none of them), and the GPUs NVML shows (none
    known while only seeding, which checks no host rule)."""
    page = functools.partial(profile_page, reading=run_reading(settings))
    host = (lambda: host_gpus(gpus.read())) if gpus is not None else HostGpus
    return ProfileFacts(roles=roles_by_profile, evidence_count=evidence_count, page=page, host_gpus=host)


def prepare_database(settings: Settings) -> tuple[Engine, str]:
    """Migrate, seed the profiles, make sure an admin can exist; returns the engine and the CSRF secret."""
    engine = create_db_engine(settings.database_path)
    migrate(engine)
    with Session(engine) as session:
        ProfileService(session, settings.models_dir, profile_facts(settings)).seed(SEED_DIR)
        setup_token = bootstrap_admin(session, settings.admin_token)
        csrf_secret = appliance_secret(session, CSRF_SECRET)
    url = settings.public_url or f"http://{settings.host}:{settings.port}"
    if setup_token is not None:
        # Printed this once only: it is stored hashed, and exchanged for the admin account at /setup.
        log.warning("setup_token", token=setup_token, exchange_at=f"{url}/setup or POST /api/setup")
    if settings.admin_token:
        how = f"operator {ENV_ADMIN!r}, token: the value of FLASHGATE_ADMIN_TOKEN"
    elif setup_token is not None:
        how = f"first exchange the setup_token above at {url}/setup for an admin and its token"
    else:
        how = "an operator's name and one of their tokens (an admin makes operators: POST /api/operators)"
    log.info("console_sign_in", url=f"{url}/signin", sign_in=how)
    return engine, csrf_secret


def log_unexpected_error(exc: Exception, scope: Scope) -> None:
    """HTTP errors are answers; anything else is a bug, logged with its traceback and the request id."""
    if not isinstance(exc, HTTPException):
        log.error("unhandled_exception", path=scope.get("path"), exc_info=exc)


def not_found(request: HTMXRequest, exc: NotFoundException) -> Response:
    """A browser's unknown path is a page; the API, the agent route and the schema answer JSON, as for any error."""
    if request.url.path.startswith((API_PREFIX, ROUTE_PREFIX, "/schema")):
        return create_exception_response(request, exc)
    if "route_handler" not in request.scope:
        # A path no route knows; a page's own 404 (an unknown profile) keeps its words.
        exc = NotFoundException(f"there is no page at {request.url.path}")
    return console_error(request, exc)


def make_driver(settings: Settings) -> EngineDriver:
    return DockerDriver(settings) if settings.supervisor == "docker" else ProcessDriver(settings.engine_port)


def create_app(settings: Settings | None = None, gpus: Gpus | None = None) -> Litestar:
    """The console. `gpus` is NVML unless a test hands in a stand-in behind the same interface."""
    settings = settings or load_settings()
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    engine, csrf_secret = prepare_database(settings)
    gpus = gpus or NvmlGpus()
    supervisor = Supervisor(settings, engine, make_driver(settings), gpus)
    telemetry = Telemetry(gpus, supervisor.target, settings.telemetry_interval_s)
    checkpoint = DemoCheckpoint(DEMO_MODEL_DIR, settings.models_dir, engine)
    qualification = load_qualification_settings()
    slot = EngineSlot(engine, supervisor, settings.engine_boot_timeout_s)
    qualifier = Qualifier(settings, qualification, engine, slot, gpus, run_reading(settings))
    route = AgentRoute(settings, engine, supervisor, slot)
    switch = Switch(settings, qualification, engine, slot, smoke=functools.partial(route_smoke, route))
    promoter = Promoter(settings, engine, slot, switch)
    watch = ProductionWatch(settings, engine, slot, promoter, route)

    def start_background_work() -> None:
        # The engine's options, asked once, in the background: the first profile write then need not wait for it.
        threading.Thread(target=warm_engine_options, name="engine-options", daemon=True).start()
        supervisor.recover()
        qualifier.recover()
        switch.recover()
        checkpoint.ensure(settings.install_demo)
        telemetry.start()
        watch.start()

    def stop_background_work() -> None:
        # The watch first (it would restart what stops), then runs and switches: they stop between steps; then the
        # engine goes with the console.
        watch.shutdown()
        qualifier.shutdown()
        switch.shutdown()
        supervisor.shutdown()
        checkpoint.stop()
        telemetry.stop()

    @get(
        "/healthz",
        sync_to_thread=False,
        include_in_schema=False,
        response_headers=[ResponseHeader(name=BUILD_HEADER, value=settings.build)],
    )
    def healthz() -> dict[str, str]:
        """The process is up; the build it runs is in the X-Flashgate-Build header."""
        return {"status": "ok"}

    @head(
        "/healthz",
        sync_to_thread=False,
        include_in_schema=False,
        response_headers=[ResponseHeader(name=BUILD_HEADER, value=settings.build)],
    )
    def healthz_head() -> None:
        """`curl -sI …/healthz`: the same answer without the body."""

    @get("/readyz", sync_to_thread=True, include_in_schema=False)
    def readyz() -> dict[str, str]:
        """The database answers, through the same engine every request uses."""
        try:
            with engine.connect() as conn:
                conn.execute(text("SELECT max(version) FROM schema_version")).scalar_one()
        except SQLAlchemyError as exc:
            raise ServiceUnavailableException(detail=f"database unreachable: {exc}") from exc
        return {"status": "ready"}

    return Litestar(
        route_handlers=[
            healthz,
            healthz_head,
            readyz,
            OperatorController,
            ProfileController,
            Router("/", route_handlers=[AuditController], guards=[requires_viewer]),
            RouteController,
            DecisionController,
            QualificationController,
            EngineController,
            TelemetryController,
            AgentController,
            KeyController,
            RouteApiController,
            console_router(
                [
                    SignInController,
                    DashboardPages,
                    ProfilePages,
                    QualificationPages,
                    DecisionPages,
                    RoutePages,
                    AgentPages,
                    AuditPages,
                ]
            ),
            create_static_files_router(path="/static", directories=[STATIC_DIR], include_in_schema=False),
        ],
        dependencies={"db_session": Provide(session_provider(engine))},
        middleware=[RequestLogMiddleware(), AuthenticationMiddleware(engine)],
        exception_handlers={NotFoundException: not_found},
        before_send=[security_headers],
        # The API and the agent route authenticate by bearer token only (never the cookie), so cross-site forms
        # cannot ride on them; probes, the schema and static files take no form.
        csrf_config=CSRFConfig(
            secret=csrf_secret,
            exclude=[f"^{API_PREFIX}", f"^{ROUTE_PREFIX}", "^/(healthz|readyz|schema|static)(/|$)"],
            cookie_httponly=True,
            cookie_secure=bool(settings.public_url and settings.public_url.startswith("https://")),
        ),
        template_config=TemplateConfig(directory=TEMPLATES_DIR, engine=JinjaTemplateEngine),
        plugins=[HTMXPlugin()],
        openapi_config=OpenAPIConfig(
            title="Flashgate console",
            version="1",
            path="/schema",
            components=Components(
                security_schemes={
                    "bearer": SecurityScheme(type="http", scheme="bearer", description="an operator token (/api)"),
                    "agentKey": SecurityScheme(type="http", scheme="bearer", description="an agent key (/v1)"),
                }
            ),
            security=[{"bearer": []}],
        ),
        state=State(
            {
                "settings": settings,
                "slot": slot,
                "profile_facts": profile_facts(settings, gpus),
                "attempts": AttemptLimit(),
                "telemetry": telemetry,
                "checkpoint": checkpoint,
                "qualifier": qualifier,
                "promoter": promoter,
                "route": route,
                "watch": watch,
            }
        ),
        # The route opens first: the switches and the watch call through it.
        on_startup=[route.open, start_background_work],
        on_shutdown=[stop_background_work, route.close, engine.dispose],
        # Our structlog setup (app/logging.py) handles every log line; Litestar's own config would replace it.
        logging_config=None,
        after_exception=[log_unexpected_error],
    )
