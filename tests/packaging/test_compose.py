"""The compose file sets, compose.yaml alone (a CPU host) and with compose.gpu.yaml (a GPU host): parsed by the real
compose (`config`, as `up` parses them), validated against the Compose Specification's JSON Schema (vendored:
tests/data/README.md) interpolated as `docker compose` would, and held to what the console expects of them: the GPU
reservation, the ports, the volumes, the settings' defaults, and the docker driver's pre-created engine container
behind a socket proxy that allows exactly what the driver does."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from app.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "tests/data/compose-spec.json").read_text())
COMPOSE_TEXT = (ROOT / "compose.yaml").read_text()
GPU_TEXT = (ROOT / "compose.gpu.yaml").read_text()
# The operators' file sets (README, docs/deploy.md).
FILE_SETS = {"cpu": ["compose.yaml"], "gpu": ["compose.yaml", "compose.gpu.yaml"]}

# ${VAR}, ${VAR:-default}, ${VAR-default}; `$$` is a literal `$`.
_VARIABLE = re.compile(r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def _interpolate(value: Any, env: dict[str, str]) -> Any:
    if isinstance(value, dict):
        return {key: _interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op = match.group("name"), match.group("op")
        if op is None:
            assert name in env, f"${{{name}}} has no default: compose would warn and use an empty string"
            return env[name]
        unset = name not in env or (op == ":-" and env[name] == "")
        return match.group("default") if unset else env[name]

    return _VARIABLE.sub(substitute, value)


def compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    return _interpolate(yaml.safe_load(COMPOSE_TEXT), env or {})


def gpu_override(env: dict[str, str] | None = None) -> dict[str, Any]:
    return _interpolate(yaml.safe_load(GPU_TEXT), env or {})


OVERRIDES = {
    "FLASHGATE_GPU_COUNT": "2",
    "FLASHGATE_PUBLISH": "127.0.0.1:9090",
    "FLASHGATE_MODELS_DIR": "/srv/flashgate/models",
    "FLASHGATE_SUPERVISOR": "docker",
    "FLASHGATE_ADMIN_TOKEN": "fg_secret",
    "FLASHGATE_COMMIT": "abc1234",
}


@pytest.mark.parametrize("env", [{}, OVERRIDES], ids=["defaults", "overrides"])
@pytest.mark.parametrize("document", [compose, gpu_override], ids=["compose.yaml", "compose.gpu.yaml"])
def test_compose_files_are_valid_against_the_compose_spec(document, env):
    jsonschema.Draft7Validator.check_schema(SCHEMA)
    errors = sorted(jsonschema.Draft7Validator(SCHEMA).iter_errors(document(env)), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)


def _compose_cli() -> list[str]:
    if shutil.which("docker") and subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if os.environ.get("CI"):
        pytest.fail("CI is set but no compose is installed: .ci/run installs Debian's docker-compose")
    pytest.skip("no compose installed (apt-get install docker-compose)")


@pytest.mark.parametrize("profile", [[], ["--profile", "docker-driver"]], ids=["default", "docker-driver"])
@pytest.mark.parametrize("file_set", FILE_SETS, ids=list(FILE_SETS))
@pytest.mark.parametrize("env", [{}, OVERRIDES], ids=["defaults", "overrides"])
def test_compose_parses_the_file_sets(file_set, profile, env):
    """What `up` would parse, by the compose installed here (compose 1.29 on CI, whose schema is older than the
    spec's: the files keep to what both accept)."""
    files = [arg for name in FILE_SETS[file_set] for arg in ("-f", name)]
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("FLASHGATE_", "COMPOSE_"))} | env
    done = subprocess.run(
        [*_compose_cli(), *files, *profile, "config"], cwd=ROOT, env=environment, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    merged = yaml.safe_load(done.stdout)
    # compose 1.29 lists every service whatever the profiles; today's compose only the active ones.
    assert "flashgate" in merged["services"] and ("engine" in merged["services"]) >= bool(profile)
    gpus = [
        s.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
        for s in merged["services"].values()
        if s.get("image", "").startswith("flashgate:")
    ]
    assert all(gpus) if file_set == "gpu" else not any(gpus), gpus


def test_schema_rejects_a_broken_compose_file():
    """The validation is real: a misspelt key and a wrong type fail it."""
    broken = compose()
    broken["services"]["flashgate"]["restart_policy"] = "always"
    broken["services"]["flashgate"]["ports"] = "8080:8080"
    messages = [e.message for e in jsonschema.Draft7Validator(SCHEMA).iter_errors(broken)]
    assert any("restart_policy" in m for m in messages) and any("is not of type 'array'" in m for m in messages)


def test_appliance_service():
    service = compose()["services"]["flashgate"]
    assert "profiles" not in service and service["command"] == ["console"]
    # A CPU host runs compose.yaml alone: no GPU reservation there, nor anything else a CPU daemon refuses.
    assert "deploy" not in service and "ulimits" not in service
    # The console and the agents' route are published; the engine's port never is.
    assert service["ports"] == ["8080:8080"]
    assert compose(OVERRIDES)["services"]["flashgate"]["ports"] == ["127.0.0.1:9090:8080"]
    assert not any(str(load_settings({}).engine_port) in str(port) for port in service["ports"])
    # The database and evidence on a named volume; the weights read-only.
    assert "flashgate-data:/data" in service["volumes"] and "flashgate-data" in compose()["volumes"]
    assert "./models:/models:ro" in service["volumes"]
    assert "/srv/flashgate/models:/models:ro" in compose(OVERRIDES)["services"]["flashgate"]["volumes"]
    assert service["shm_size"] == "16g" and service["restart"] == "unless-stopped" and service["init"] is True
    assert service["healthcheck"]["test"] == ["CMD", "flashgate", "healthcheck"]
    # Compose stops the container only after the console has drained its engine.
    assert _seconds(service["stop_grace_period"]) > load_settings({}).engine_grace_s


def test_gpu_file_adds_the_reservation_to_both_gpu_services_and_nothing_else():
    services = gpu_override()["services"]
    assert set(services) == {"flashgate", "engine"} <= set(compose()["services"])
    for name, service in services.items():
        assert set(service) == {"deploy", "ulimits"}, name
        assert service["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}
        ]
        assert service["ulimits"] == {"memlock": -1}
    gpus = gpu_override(OVERRIDES)["services"]["flashgate"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert int(gpus["count"]) == 2


def test_console_settings_in_compose_match_the_console_defaults():
    """What compose passes to the console is what the console reads: fixed container paths, and the same defaults as
    load_settings (README, "Settings"), except the demo model's install, which a read-only /models cannot hold."""
    env = compose()["services"]["flashgate"]["environment"]
    settings, defaults = load_settings(env), load_settings({})
    assert (str(settings.data_dir), str(settings.models_dir), settings.host, settings.port) == (
        "/data",
        "/models",
        "0.0.0.0",
        8080,
    )
    for field in ("supervisor", "admin_token", "engine_grace_s", "engine_boot_timeout_s", "engine_health_timeout_s"):
        assert getattr(settings, field) == getattr(defaults, field), field
    assert settings.log_json is True and settings.install_demo is False
    overridden = load_settings(compose(OVERRIDES)["services"]["flashgate"]["environment"])
    assert overridden.supervisor == "docker" and overridden.admin_token == "fg_secret"


def test_docker_driver_profile_matches_the_console_defaults():
    """`--profile docker-driver` adds the pre-created engine container and the socket proxy, named as the console's
    FLASHGATE_DOCKER_* defaults expect them, and reachable only as they must be."""
    services, defaults = compose()["services"], load_settings({})
    engine, proxy = services["engine"], services["docker-proxy"]
    assert engine["profiles"] == ["docker-driver"] and proxy["profiles"] == ["docker-driver"]
    assert defaults.docker_host == "tcp://docker-proxy:2375" and defaults.docker_engine_host == "engine"
    assert engine["container_name"] == defaults.docker_container
    assert engine["image"] == services["flashgate"]["image"] and engine["command"] == ["engine"]
    assert engine["volumes"] == services["flashgate"]["volumes"]
    assert engine["restart"] == "no" and "ports" not in engine and engine["healthcheck"] == {"disable": True}
    # The proxy: built here from Debian's haproxy, filtering on the engine container's name, never published, on an
    # internal network it shares with the console alone. tests/container/test_docker_driver.py runs it.
    assert proxy["image"] == "flashgate-docker-proxy:local" and proxy["build"]["context"] == "deploy/docker-proxy"
    assert proxy["environment"] == {"ENGINE_CONTAINER": defaults.docker_container}
    assert "ports" not in proxy and proxy["networks"] == ["docker-control"]
    assert compose()["networks"]["docker-control"] == {"internal": True}
    assert [name for name, s in services.items() if "docker-control" in s.get("networks", [])] == [
        "flashgate",
        "docker-proxy",
    ]
    assert "/var/run/docker.sock:/var/run/docker.sock:ro" in proxy["volumes"]
    assert "root-equivalent" in COMPOSE_TEXT


def test_socket_proxy_config_is_valid_haproxy():
    """`haproxy -c` on the shipped filter, where Debian's haproxy is installed (.ci/dockerd installs it)."""
    if shutil.which("haproxy") is None:
        if os.environ.get("CI"):
            pytest.fail("CI is set but haproxy is not installed: .ci/dockerd installs it")
        pytest.skip("haproxy is not installed (apt-get install haproxy)")
    done = subprocess.run(
        ["haproxy", "-c", "-f", str(ROOT / "deploy/docker-proxy/haproxy.cfg")],
        env={"ENGINE_CONTAINER": load_settings({}).docker_container, "PATH": os.environ["PATH"]},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def _seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration))
