"""Console settings, read once from FLASHGATE_* environment variables (all listed in the README)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


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

    @property
    def database_path(self) -> Path:
        return self.data_dir / "flashgate.sqlite3"


def _flag(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in {"1", "true", "yes", "on"}


def load_settings(env: dict[str, str] | None = None) -> Settings:
    env = dict(os.environ if env is None else env)
    data_dir = Path(env.get("FLASHGATE_DATA_DIR", "./data")).resolve()
    supervisor = env.get("FLASHGATE_SUPERVISOR", "process")
    if supervisor not in {"process", "docker"}:
        raise ValueError(f"FLASHGATE_SUPERVISOR must be 'process' or 'docker', got {supervisor!r}")
    return Settings(
        data_dir=data_dir,
        models_dir=Path(env.get("FLASHGATE_MODELS_DIR", str(data_dir / "models"))).resolve(),
        host=env.get("FLASHGATE_HOST", "127.0.0.1"),
        port=int(env.get("FLASHGATE_PORT", "8080")),
        engine_port=int(env.get("FLASHGATE_ENGINE_PORT", "30000")),
        supervisor=supervisor,
        admin_token=env.get("FLASHGATE_ADMIN_TOKEN") or None,
        log_json=_flag(env.get("FLASHGATE_LOG_JSON")),
    )
