"""`python -m app` comes up as a real process on a real SQLite directory, answers its health probes, logs JSON
lines that carry each request's id, and prints the one-time setup token exactly once. On first start it installs
the shipped demo model, and cpu-demo serves it; killed with its engine running, the next console stops that engine
and closes its run."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.support import DEMO_MODEL_DIR, free_port, start_console, wait_until

ADMIN_TOKEN = "fg_process-test-admin"


def test_console_starts_and_answers_health(tmp_path):
    port = free_port()
    settings = {
        "FLASHGATE_DATA_DIR": str(tmp_path / "data"),
        "FLASHGATE_PORT": str(port),
        "FLASHGATE_LOG_JSON": "1",
        "FLASHGATE_INSTALL_DEMO": "0",
        "FLASHGATE_ADMIN_TOKEN": None,
    }
    log = tmp_path / "console.log"
    proc = start_console(settings, log)
    try:
        health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        ready = httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
        assert (tmp_path / "data").is_dir()
        request_id = ready.headers["x-request-id"]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert any(e["event"] == "request" and e.get("request_id") == request_id and e["status"] == 200 for e in lines)
    assert [e["event"] for e in lines].count("setup_token") == 1
    assert any(e["event"] == "profiles_seeded" for e in lines)


def _console(data_dir: Path, port: int, engine_port: int, log: Path):
    settings = {
        "FLASHGATE_DATA_DIR": str(data_dir),
        "FLASHGATE_PORT": str(port),
        "FLASHGATE_ENGINE_PORT": str(engine_port),
        "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "FLASHGATE_LOG_JSON": "1",
        "FLASHGATE_ENGINE_GRACE_S": "10",
        "FLASHGATE_INSTALL_DEMO": None,
    }
    return start_console(settings, log, timeout=90)


def _running(pid: int) -> bool:
    """Alive and not a zombie (the engine outlived its console, so its new parent reaps it, or may not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_first_start_installs_the_demo_model_and_a_restart_reclaims_a_left_engine(tmp_path):
    data_dir, log = tmp_path / "data", tmp_path / "console.log"
    port, engine_port = free_port(), free_port()
    api, admin = f"http://127.0.0.1:{port}/api", {"Authorization": f"Bearer {ADMIN_TOKEN}"}

    def engine() -> dict:
        return httpx.get(f"{api}/engine", headers=admin, timeout=5).json()

    first = _console(data_dir, port, engine_port, log)
    try:
        assert engine()["demo_checkpoint"]["state"] in ("installing", "present")
        wait_until(lambda: engine()["demo_checkpoint"]["state"] == "present", "installed", 90, first, log)
        installed = data_dir / "models" / "demo"
        for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "SHA256SUMS"):
            assert (installed / name).read_bytes() == (DEMO_MODEL_DIR / name).read_bytes(), name
        assert not (data_dir / "models" / ".demo.partial").exists()
        assert httpx.get(f"{api}/profiles/cpu-demo", headers=admin).json()["state"]["blockers"] == []
        started = httpx.post(f"{api}/engine/start", json={"profile": "cpu-demo"}, headers=admin, timeout=30)
        assert started.status_code == 202, started.text
        wait_until(lambda: engine()["state"] == "ready", "ready", 90, first, log)
        run = engine()["run"]
        assert run["server_info"]["model"] == str(installed)
        served = httpx.post(
            f"http://127.0.0.1:{engine_port}/v1/completions",
            json={"model": "cpu-demo", "prompt": "Hello", "max_tokens": 4, "ignore_eos": True},
            timeout=60,
        )
        assert served.status_code == 200 and served.json()["usage"]["completion_tokens"] == 4, served.text
    finally:
        first.kill()  # no shutdown: the engine is left running, as after a crash of the console
        first.wait(timeout=20)
    assert httpx.get(f"http://127.0.0.1:{engine_port}/health", timeout=5).status_code == 200

    second = _console(data_dir, port, engine_port, log)
    try:
        closed = engine()
        assert closed["state"] == "stopped" and closed["run"]["id"] == run["id"]
        assert closed["run"]["last_error"] == (
            f"the console restarted while this engine was ready: its process {run['pid']} was still running "
            f"and was stopped"
        )
        assert not _running(run["pid"])
        actions = [r["action"] for r in httpx.get(f"{api}/audit", headers=admin).json()]
        assert {
            "checkpoint.install",
            "checkpoint.installed",
            "engine.start",
            "engine.ready",
            "engine.reclaimed",
        } <= set(actions)
        assert actions.count("checkpoint.install") == 1  # the second start found it installed
        assert [r["id"] for r in httpx.get(f"{api}/engine/runs", headers=admin).json()] == [run["id"]]
    finally:
        second.terminate()
        second.wait(timeout=30)
