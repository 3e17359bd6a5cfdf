"""`python -m app` comes up as a real process on a real SQLite directory, answers its health probes, logs JSON
lines that carry each request's id, and prints the one-time setup token exactly once."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_console_starts_and_answers_health(tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "FLASHGATE_DATA_DIR": str(tmp_path / "data"),
        "FLASHGATE_PORT": str(port),
        "FLASHGATE_LOG_JSON": "1",
    }
    env.pop("FLASHGATE_ADMIN_TOKEN", None)
    log = tmp_path / "console.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "app"], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"console exited early:\n{log.read_text()}"
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "console did not answer /healthz within 60 s"
                time.sleep(0.2)
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
