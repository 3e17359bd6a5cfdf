"""The supervisor through the console's API and pages, on a real SQLite file, against both drivers through the one
interface: `process` runs the real engine as the console's child (the shipped demo model on CPU); `docker` drives the
recorded Docker Engine API (docker_replay.py), with a real engine standing in for the container's process on the
URL the driver reads /health, /server_info and /metrics from. Start → ready → KV capacity as /server_info says →
stop; a second start refused naming the running profile; a restart; a crash shows the last log lines; a hang
is killed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from litestar.testing import TestClient

from app.main import create_app
from app.settings import load_settings
from tests.console.conftest import ADMIN_TOKEN
from tests.console.docker_replay import DockerReplay
from tests.support import free_port, sign_in

pytestmark = pytest.mark.slow

ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# The acceptance limits: small enough for a CPU, and a child of cpu-demo that changes one thing from its parent.
PROFILE = "demo-1k"
LIMITS = {"context_length": 1024, "max_num_seqs": 2, "max_num_batched_tokens": 256, "cuda_graph_max_bs": 1}
GRACE_S = 10
HEALTH_TIMEOUT_S = 2
LOG_RETENTION = 3


@dataclass
class Console:
    driver: str
    client: TestClient
    engine_url: str
    data_dir: Path
    # Kills the engine under the console: SIGKILL to the child, or the container "killed" (exit 137) in the replay.
    crash: Callable[[dict], None]
    # Freezes the engine's process (SIGSTOP): it runs, but /health stops answering.
    hang: Callable[[dict], None]
    replay: DockerReplay | None = None

    def engine(self) -> dict:
        response = self.client.get("/api/engine", headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def wait(self, predicate: Callable[[dict], bool], what: str, timeout: float = 90) -> dict:
        deadline = time.monotonic() + timeout
        while not predicate(body := self.engine()):
            assert time.monotonic() < deadline, f"engine not {what} within {timeout} s: {json.dumps(body)[:2000]}"
            time.sleep(0.1)
        return body

    def start(self, profile: str = PROFILE) -> dict:
        response = self.client.post("/api/engine/start", json={"profile": profile}, headers=ADMIN)
        assert response.status_code == 202, response.text
        started = response.json()
        assert started["run"]["state"] == "starting" and started["profile"] == profile
        ready = self.wait(lambda b: b["run"]["state"] != "starting", "up")
        assert ready["run"]["id"] == started["run"]["id"] and ready["state"] == "ready", json.dumps(ready)[:4000]
        return ready

    def stop(self) -> dict:
        response = self.client.post("/api/engine/stop", headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def audit(self, run_id: int) -> list[str]:
        rows = self.client.get("/api/audit", params={"target": f"engine_run:{run_id}"}, headers=ADMIN).json()
        return [r["action"] for r in reversed(rows)]


def _settings(data_dir: Path, models_dir: Path, **env: str):
    return load_settings(
        {
            "FLASHGATE_DATA_DIR": str(data_dir),
            "FLASHGATE_MODELS_DIR": str(models_dir),
            "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "FLASHGATE_INSTALL_DEMO": "0",
            "FLASHGATE_ENGINE_GRACE_S": str(GRACE_S),
            "FLASHGATE_ENGINE_HEALTH_TIMEOUT_S": str(HEALTH_TIMEOUT_S),
            "FLASHGATE_TELEMETRY_INTERVAL_S": "0.5",
            "FLASHGATE_LOG_RETENTION": str(LOG_RETENTION),
            **env,
        }
    )


def _stand_in_engine(models_dir: Path, port: int, log: Path) -> subprocess.Popen:
    """The real engine the docker driver talks to over HTTP: what the container would run."""
    args = ["--model", str(models_dir / "demo"), "--served-model-name", PROFILE, "--dtype", "float32"]
    args += ["--context-length", "1024", "--max-num-seqs", "2", "--max-num-batched-tokens", "256"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "engine", "serve", *args, "--port", str(port)], stdout=out, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)


@pytest.fixture(scope="module", params=["process", "docker"])
def console(request, tmp_path_factory, demo_models_dir) -> Iterator[Console]:
    data_dir = tmp_path_factory.mktemp(f"console-{request.param}") / "data"
    port = free_port()
    if request.param == "process":
        app = create_app(_settings(data_dir, demo_models_dir, FLASHGATE_ENGINE_PORT=str(port)))
        with TestClient(app) as client:
            yield Console(
                "process",
                client,
                f"http://127.0.0.1:{port}",
                data_dir,
                crash=lambda run: os.kill(run["pid"], signal.SIGKILL),
                hang=lambda run: os.kill(run["pid"], signal.SIGSTOP),
            )
        return
    stand_in = _stand_in_engine(demo_models_dir, port, data_dir.parent / "stand-in.log")
    try:
        with DockerReplay() as replay:
            settings = _settings(
                data_dir,
                demo_models_dir,
                FLASHGATE_SUPERVISOR="docker",
                FLASHGATE_DOCKER_HOST=replay.base_url,
                FLASHGATE_DOCKER_ENGINE_HOST="127.0.0.1",
                FLASHGATE_ENGINE_PORT=str(port),
            )
            with TestClient(create_app(settings)) as client:
                yield Console(
                    "docker",
                    client,
                    f"http://127.0.0.1:{port}",
                    data_dir,
                    crash=lambda run: replay.set_state("crashed"),
                    hang=lambda run: os.kill(stand_in.pid, signal.SIGSTOP),
                    replay=replay,
                )
            assert replay.unrecorded() == [], "the console asked the Docker API for something not recorded"
    finally:
        stand_in.kill()  # it may be frozen by the hang test
        stand_in.wait(timeout=30)


@pytest.fixture(scope="module", autouse=True)
def demo_1k(console: Console) -> None:
    response = console.client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": PROFILE, "rationale": "the acceptance limits: a CPU holds them", **LIMITS},
        headers=ADMIN,
    )
    assert response.status_code == 201, response.text
    sign_in(console.client, "admin", ADMIN_TOKEN)


def test_start_ready_shows_the_measured_kv_capacity_then_stop(console: Console):
    ready = console.start()
    run = ready["run"]
    info = httpx.get(f"{console.engine_url}/server_info", timeout=5).json()
    assert run["kv_capacity_tokens"] == info["kv_capacity_tokens"] > 0
    assert run["max_concurrency_at_full_context"] == info["max_concurrency_at_full_context"]
    profile = console.client.get(f"/api/profiles/{PROFILE}", headers=ADMIN).json()
    assert run["content_hash"] == profile["content_hash"] and len(run["weights_fingerprint"]) == 64
    assert [s["stage"] for s in run["boot_stages"]] == ["weights", "kv_alloc", "graph_capture", "ready"]
    assert run["ready_line"]["context_len"] == 1024 and run["ready_line"]["max_num_seqs"] == 2
    assert {c["name"]: c["status"] for c in run["preflight"]}["weights"] == "ok"
    assert ready["driver"] == console.driver and ready["engine_url"] == console.engine_url
    if console.driver == "process":
        assert run["pid"] and run["container"] is None
        assert run["command"][run["command"].index("--context-length") + 1] == "1024"
    else:
        assert run["container"] == "flashgate-engine (8f3c2a1b9d7e)" and run["pid"] is None
        handoff = json.loads((console.data_dir / "engine-profile.json").read_text())
        assert handoff["profile"] == PROFILE and handoff["run"] == run["id"] and handoff["args"] == run["command"]
        assert handoff["args"][handoff["args"].index("--host") + 1] == "0.0.0.0"

    # The dashboard shows it, and the telemetry reads the engine's own /metrics.
    live = console.client.get("/dashboard/live")
    assert f'id="kv-capacity">{info["kv_capacity_tokens"]:,}<' in live.text
    deadline = time.monotonic() + 10
    while (telemetry := console.client.get("/api/telemetry", headers=ADMIN).json())["engine"] is None:
        assert time.monotonic() < deadline, telemetry
        time.sleep(0.2)
    assert telemetry["engine"]["kv_capacity_tokens"] == info["kv_capacity_tokens"]
    assert telemetry["engine"]["kv_used_tokens"] == 0 and telemetry["engine"]["requests_running"] == 0
    assert telemetry["gpus"]["available"] is False and "NVML" in telemetry["gpus"]["reason"]

    # One engine owns the GPUs.
    second = console.client.post("/api/engine/start", json={"profile": "cpu-demo"}, headers=ADMIN)
    assert second.status_code == 409
    assert second.json()["detail"].startswith(f"engine already running profile '{PROFILE}' since ")

    stopped = console.stop()["run"]
    assert stopped["state"] == "stopped" and stopped["exit_code"] == 0 and stopped["stopped_by"] == "admin"
    assert stopped["gpu_release"]["status"] == "n/a"
    if console.driver == "process":
        with pytest.raises(ProcessLookupError):
            os.kill(run["pid"], 0)
    else:
        (stop,) = console.replay.calls("POST", "/stop")
        assert stop.query == {"t": [str(GRACE_S)]}
    tail = console.client.get("/api/engine/logs", params={"run": run["id"]}, headers=ADMIN).json()
    assert tail["retained"] and any(line.startswith("engine ready: context_len=1024") for line in tail["lines"])
    assert console.audit(run["id"]) == ["engine.start", "engine.ready", "engine.stop", "engine.stopped"]
    again = console.client.post("/api/engine/stop", headers=ADMIN)
    assert again.status_code == 409 and again.json()["detail"] == "no engine is running"


def test_a_boot_can_be_stopped(console: Console):
    started = console.client.post("/api/engine/start", json={"profile": PROFILE}, headers=ADMIN).json()["run"]
    stopped = console.stop()["run"]
    assert stopped["id"] == started["id"] and stopped["state"] == "stopped" and stopped["ready_at"] is None
    assert console.audit(started["id"]) == ["engine.start", "engine.stop", "engine.stopped"]


def test_restart_starts_a_new_run_of_the_same_profile(console: Console):
    first = console.start()["run"]
    response = console.client.post("/api/engine/restart", json={}, headers=ADMIN)
    assert response.status_code == 202, response.text
    second = console.wait(lambda b: b["run"]["id"] != first["id"] and b["state"] == "ready", "ready again")["run"]
    assert second["profile"] == PROFILE
    runs = {r["id"]: r for r in console.client.get("/api/engine/runs", headers=ADMIN).json()}
    assert runs[first["id"]]["state"] == "stopped" and runs[first["id"]]["stopped_by"] == "admin"
    console.stop()


def test_a_crash_is_detected_with_the_last_log_lines(console: Console):
    run = console.start()["run"]
    console.crash(run)
    crashed = console.wait(lambda b: b["state"] == "crashed", "crashed", timeout=30)["run"]
    signal_exit = "exit code -9 (SIGKILL)" if console.driver == "process" else "exit code 137 (SIGKILL)"
    assert crashed["last_error"] == f"the engine exited with {signal_exit}"
    assert crashed["exit_code"] in (-9, 137) and crashed["stopped_by"] is None
    assert any(line.startswith("engine ready:") for line in crashed["last_lines"])
    assert console.audit(run["id"])[-1] == "engine.crashed"
    page = console.client.get("/dashboard")
    assert "Crashed:" in page.text and signal_exit in page.text and "engine ready: context_len=1024" in page.text
    # Crashed is not running: the next start is allowed.
    assert console.client.post("/api/engine/stop", headers=ADMIN).status_code == 409


def test_a_hung_engine_is_killed_and_marked_crashed(console: Console):
    run = console.start()["run"]
    console.hang(run)
    crashed = console.wait(lambda b: b["state"] == "crashed", "declared hung", timeout=30)["run"]
    assert crashed["last_error"].startswith(f"/health stopped answering for {HEALTH_TIMEOUT_S} s")
    assert console.audit(run["id"])[-1] == "engine.crashed"
    if console.driver == "process":
        assert crashed["exit_code"] == -9
        with pytest.raises(ProcessLookupError):
            os.kill(run["pid"], 0)
    else:
        # A kill is a stop with no grace: the proxy allows nothing more.
        assert console.replay.calls("POST", "/stop")[-1].query == {"t": ["0"]}


def test_only_the_latest_starts_keep_their_logs(console: Console):
    runs = console.client.get("/api/engine/runs", headers=ADMIN).json()
    assert len(runs) > LOG_RETENTION  # the tests above started the engine six times
    assert [r["log_retained"] for r in runs] == [True] * LOG_RETENTION + [False] * (len(runs) - LOG_RETENTION)
    assert len(list((console.data_dir / "engine-logs").glob("run-*.log"))) == LOG_RETENTION
    page = console.client.get(f"/engine/runs/{runs[-1]['id']}")
    assert page.status_code == 200 and "only the latest starts' logs are kept" in page.text
