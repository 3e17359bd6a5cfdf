"""The docker driver for real (`FLASHGATE_SUPERVISOR=docker docker compose --profile docker-driver up -d`, the
operators' CPU file set): the console container starts, watches and stops the engine container that compose
made, through the filtering socket proxy (deploy/docker-proxy/, Debian's HAProxy) and never through the socket;
the proxy lets the console inspect, read the logs of, start and stop that one container, and refuses creating a
container, exec, the other containers and the rest of the API."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.container.conftest import ADMIN, ROOT, Stack, wait

pytestmark = pytest.mark.container

ENGINE = "flashgate-engine"

# Asked from inside the console's container, on the docker-control network, as the driver would ask.
PROBE = """
import json, sys
import httpx

console = sys.argv[1]
asks = [
    ("GET", "/_ping"), ("GET", "/v1.41/version"),
    ("GET", "/v1.41/containers/flashgate-engine/json"), ("GET", "/v1.41/containers/flashgate-engine/logs?stdout=1"),
    ("POST", "/v1.41/containers/create"), ("POST", "/v1.41/containers/flashgate-engine/exec"),
    ("POST", "/v1.41/containers/flashgate-engine/kill"), ("POST", "/v1.41/containers/flashgate-engine/restart"),
    ("DELETE", "/v1.41/containers/flashgate-engine"), ("GET", "/v1.41/containers/json"),
    ("GET", f"/v1.41/containers/{console}/json"), ("POST", f"/v1.41/containers/{console}/stop"),
    ("GET", "/v1.41/images/json"), ("GET", "/v1.41/info"), ("POST", "/v1.41/volumes/create"),
    ("GET", "/v1.41/events"), ("POST", "/v1.41/build"),
]
with httpx.Client(base_url="http://docker-proxy:2375", timeout=10) as client:
    print(json.dumps({f"{method} {path}": client.request(method, path).status_code for method, path in asks}))
"""

ALLOWED = {
    "GET /_ping",
    "GET /v1.41/version",
    "GET /v1.41/containers/flashgate-engine/json",
    "GET /v1.41/containers/flashgate-engine/logs?stdout=1",
}


@pytest.fixture(scope="module")
def proxy_image(image) -> str:
    done = subprocess.run(["make", "image-docker-proxy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return "flashgate-docker-proxy:local"


def _running(stack: Stack, container: str) -> bool:
    return stack.inspect(container, "{{.State.Running}}") == "true"


def test_console_drives_the_engine_container_through_the_proxy(make_stack, proxy_image):
    stack = make_stack("flashgate-ci-docker", ["compose.yaml"], ["docker-driver"], FLASHGATE_SUPERVISOR="docker")
    stack.compose("up", "-d")
    console = stack.wait_healthy()
    assert stack.container("engine") == stack.inspect(ENGINE, "{{.Id}}")
    # The console has no socket: only the proxy mounts it.
    mounts = {
        name: stack.inspect(stack.container(name), "{{range .Mounts}}{{.Source}} {{end}}").split()
        for name in ("flashgate", "engine", "docker-proxy")
    }
    assert [name for name, sources in mounts.items() if "/var/run/docker.sock" in sources] == ["docker-proxy"]

    started = stack.http.post("/api/engine/start", json={"profile": "cpu-demo"}, headers=ADMIN)
    assert started.status_code == 202, started.text
    wait(lambda: stack.get("/api/engine")["state"] == "ready", "engine ready", 300, stack)
    engine = stack.get("/api/engine")
    assert engine["driver"] == "docker" and ENGINE in engine["run"]["container"], engine
    assert _running(stack, ENGINE) and stack.exec(ENGINE, "id", "-u").strip() == "10001"
    # The engine's log came through the proxy's log stream into the run's log on the volume.
    assert stack.exec(console, "cat", engine["run"]["log_path"]).strip()

    answers = json.loads(stack.exec(console, "python", "-", console, stdin=PROBE))
    assert {ask for ask, status in answers.items() if status == 200} == ALLOWED, answers
    assert {ask: status for ask, status in answers.items() if ask not in ALLOWED} == {
        ask: 403 for ask in answers if ask not in ALLOWED
    }
    assert _running(stack, console) and _running(stack, ENGINE)

    stopped = stack.http.post("/api/engine/stop", headers=ADMIN)
    assert stopped.status_code == 200, stopped.text
    assert stack.get("/api/engine")["state"] == "stopped"
    assert not _running(stack, ENGINE)
