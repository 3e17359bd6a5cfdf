"""Console settings, read once from FLASHGATE_* environment variables (all listed in the README)."""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

SUPERVISORS = ("process", "docker")


@dataclass(frozen=True)
class Settings:
    data_dir: Path
    models_dir: Path
    host: str
    port: int
    engine_port: int
    supervisor: str
    admin_token: str | None
    log_json: bool | None
    # The engine's lifecycle: SIGTERM grace before a kill, how long a boot and a silent /health may take.
    engine_grace_s: float
    engine_boot_timeout_s: float
    engine_health_timeout_s: float
    # Engine logs are kept for this many of the latest starts.
    log_retention: int
    telemetry_interval_s: float
    # Install the shipped demo checkpoint (engine/demo_model) as FLASHGATE_MODELS_DIR/demo on start when it is missing
    # or is not the one shipped.
    install_demo: bool
    # The docker driver: the socket proxy, the pre-created engine container, and its host name on the network.
    docker_host: str
    docker_container: str
    docker_engine_host: str
    # The build id the console shows (footer, /healthz header); the engine reports the same in /server_info.
    build: str
    # The agent route: the one model id agents use whichever profile serves, the Retry-After it answers while no
    # production engine is ready, how long it waits between an engine's bytes, and the URL clients are told to use
    # (unset: the URL the operator reached the console at).
    route_alias: str
    route_retry_after_s: int
    route_read_timeout_s: float
    public_url: str | None
    # The production watch: how often it checks production, how long an engine with work may run no step (or an idle
    # one leave its canary unanswered) before it is hung, and how many restarts within the window it tries before
    # rolling back to the last known good.
    watch_interval_s: float
    watch_canary_timeout_s: float
    watch_restarts: int
    watch_window_s: float
    # At console start, start the production profile again unless an operator stopped it (app/route/watch.py).
    resume_production: bool

    @property
    def database_path(self) -> Path:
        return self.data_dir / "flashgate.sqlite3"

    @property
    def engine_logs_dir(self) -> Path:
        return self.data_dir / "engine-logs"

    @property
    def engine_handoff_path(self) -> Path:
        """Where the docker driver hands the profile to the engine container's entrypoint (a shared volume)."""
        return self.data_dir / "engine-profile.json"


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in {"1", "true", "yes", "on"}


def _positive(env: dict[str, str], name: str, default: str, kind: type[int] | type[float]) -> int | float:
    raw = env.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ValueError(f"{name} must be a positive {'whole ' if kind is int else ''}number, got {raw!r}")
    return value


def _alias(value: str) -> str:
    """The served-model alias goes into clients' configuration files and URLs: a plain identifier."""
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}", value):
        raise ValueError(
            f"FLASHGATE_ROUTE_ALIAS must be letters, digits, '.', '_', ':' or '-' (at most 128), got {value!r}"
        )
    return value


def build_id(env: dict[str, str]) -> str:
    """FLASHGATE_BUILD (the image bakes it in: version+commit), else `git describe` of this checkout, else "dev":
    the same rule as the engine's (engine/server/info.py), so both planes name the same build."""
    if build := env.get("FLASHGATE_BUILD"):
        return build
    try:
        described = subprocess.run(
            ["git", "describe", "--always", "--dirty", "--tags"],
            cwd=Path(__file__).resolve().parents[1],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return "dev"
    return described.stdout.strip() or "dev"


def load_settings(env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    data_dir = Path(env.get("FLASHGATE_DATA_DIR", "./data")).resolve()
    supervisor = env.get("FLASHGATE_SUPERVISOR", "process")
    if supervisor not in SUPERVISORS:
        raise ValueError(f"FLASHGATE_SUPERVISOR must be 'process' or 'docker', got {supervisor!r}")
    if "FLASHGATE_MAKE_TINY" in env:
        # The console no longer makes the random tiny checkpoint: cpu-demo serves the shipped demo model.
        raise ValueError(
            "FLASHGATE_MAKE_TINY is gone: the console installs the shipped demo model instead of making the tiny "
            "one; set FLASHGATE_INSTALL_DEMO (1 or 0) in its place"
        )
    return Settings(
        data_dir=data_dir,
        models_dir=Path(env.get("FLASHGATE_MODELS_DIR", str(data_dir / "models"))).resolve(),
        host=env.get("FLASHGATE_HOST", "127.0.0.1"),
        port=int(env.get("FLASHGATE_PORT", "8080")),
        engine_port=int(env.get("FLASHGATE_ENGINE_PORT", "30000")),
        supervisor=supervisor,
        admin_token=env.get("FLASHGATE_ADMIN_TOKEN") or None,
        log_json=_flag(env.get("FLASHGATE_LOG_JSON")),
        engine_grace_s=_positive(env, "FLASHGATE_ENGINE_GRACE_S", "30", float),
        engine_boot_timeout_s=_positive(env, "FLASHGATE_ENGINE_BOOT_TIMEOUT_S", "1800", float),
        engine_health_timeout_s=_positive(env, "FLASHGATE_ENGINE_HEALTH_TIMEOUT_S", "30", float),
        log_retention=_positive(env, "FLASHGATE_LOG_RETENTION", "20", int),
        telemetry_interval_s=_positive(env, "FLASHGATE_TELEMETRY_INTERVAL_S", "2", float),
        install_demo=_flag(env.get("FLASHGATE_INSTALL_DEMO")) is not False,
        docker_host=env.get("FLASHGATE_DOCKER_HOST", "tcp://docker-proxy:2375"),
        docker_container=env.get("FLASHGATE_DOCKER_CONTAINER", "flashgate-engine"),
        docker_engine_host=env.get("FLASHGATE_DOCKER_ENGINE_HOST", "engine"),
        build=build_id(env),
        route_alias=_alias(env.get("FLASHGATE_ROUTE_ALIAS", "deepseek-v4-flash")),
        route_retry_after_s=_positive(env, "FLASHGATE_ROUTE_RETRY_AFTER_S", "5", int),
        route_read_timeout_s=_positive(env, "FLASHGATE_ROUTE_READ_TIMEOUT_S", "900", float),
        public_url=(env.get("FLASHGATE_PUBLIC_URL") or "").rstrip("/") or None,
        watch_interval_s=_positive(env, "FLASHGATE_WATCH_INTERVAL_S", "15", float),
        watch_canary_timeout_s=_positive(env, "FLASHGATE_WATCH_CANARY_TIMEOUT_S", "60", float),
        watch_restarts=_positive(env, "FLASHGATE_WATCH_RESTARTS", "3", int),
        watch_window_s=_positive(env, "FLASHGATE_WATCH_WINDOW_S", "900", float),
        resume_production=_flag(env.get("FLASHGATE_RESUME_PRODUCTION")) is not False,
    )
