"""bin/flashgate, the image's entrypoint, run natively as `make run` runs it: console mode comes up and answers
/healthz with the build id; engine mode waits for the docker driver's handoff file (written by the driver's own
code), then becomes `python -m engine serve` on the tiny checkpoint with the profile's arguments, in the same
process, so the container's stop signal reaches the engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from app.engine_control.docker_driver import DockerDriver
from app.engine_control.driver import EngineCommand, engine_args
from app.main import BUILD_HEADER
from app.profiles.models import Profile
from app.settings import load_settings
from tests.support import ROOT, OutputLines, copy_demo_model, free_port, terminate, wait_until

ENTRYPOINT = ROOT / "bin" / "flashgate"
BUILD = "9.9.9+packaging-test"
BOOT_TIMEOUT_S = 120


def entrypoint_env(data_dir: Path, **extra: str) -> dict[str, str]:
    env = {
        **os.environ,
        "FLASHGATE_PYTHON": sys.executable,
        "FLASHGATE_DATA_DIR": str(data_dir),
        "FLASHGATE_BUILD": BUILD,
        "FLASHGATE_LOG_JSON": "1",
        "OMP_NUM_THREADS": "1",
        **extra,
    }
    for name in ("FLASHGATE_HOST", "FLASHGATE_PORT", "FLASHGATE_ADMIN_TOKEN", "FLASHGATE_SUPERVISOR"):
        if name not in extra:
            env.pop(name, None)
    return env


class Running(OutputLines):
    """The entrypoint as a process, its output lines read as they come."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(
            subprocess.Popen(
                ["sh", str(ENTRYPOINT), *args],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )

    def argv(self) -> list[str]:
        return Path(f"/proc/{self.proc.pid}/cmdline").read_bytes().decode().split("\0")

    def stop(self, timeout: float = 30) -> int:
        return terminate(self.proc, timeout)


def healthcheck(port: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(ENTRYPOINT), "healthcheck"],
        env=entrypoint_env(Path("unused"), FLASHGATE_PORT=str(port)),
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_console_mode_answers_healthz_with_the_build(tmp_path):
    port = free_port()
    env = entrypoint_env(
        tmp_path / "data", FLASHGATE_PORT=str(port), FLASHGATE_INSTALL_DEMO="0", FLASHGATE_ADMIN_TOKEN="fg_pkg-test"
    )
    console = Running([], env)  # no command: the console, as the image's CMD and `make run` start it
    try:
        healthz = f"http://127.0.0.1:{port}/healthz"
        wait_until(lambda: httpx.get(healthz, timeout=1).status_code == 200, "answering /healthz", proc=console.proc)
        health = httpx.get(healthz, timeout=1)
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert health.headers[BUILD_HEADER] == BUILD
        assert f"Flashgate build {BUILD}</footer>" in httpx.get(f"http://127.0.0.1:{port}/signin", timeout=5).text
        # The shell exec'd the console: the entrypoint's process is Python itself, which gets the stop signal.
        assert console.argv()[1:3] == ["-m", "app"]
        assert healthcheck(port).returncode == 0
    finally:
        code = console.stop()
    # A graceful shutdown; uvicorn then re-raises the SIGTERM it caught, as a signalled exit.
    assert code in (0, -signal.SIGTERM)
    console.wait_for(lambda line: "Application shutdown complete" in line, 5)
    failed = healthcheck(port)
    assert failed.returncode != 0 and f"127.0.0.1:{port}/healthz" in failed.stderr


def _cpu_demo_command(models_dir: Path, port: int) -> EngineCommand:
    """The cpu-demo profile's engine command line, as the console builds it for the docker driver."""
    fields = yaml.safe_load((ROOT / "profiles" / "cpu-demo.yaml").read_text())
    profile = Profile(**fields, content_hash="packaging-test", created_by="test")
    args = engine_args(profile, models_dir, "127.0.0.1", port)
    # What a profile's `gpus` adds to the engine's environment, here only the half that is harmless on any host.
    return EngineCommand(7, profile.name, profile.content_hash, args, {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})


@pytest.mark.slow  # an engine subprocess
def test_engine_mode_waits_for_the_handoff_then_serves_it(tmp_path):
    data_dir, models_dir = tmp_path / "data", tmp_path / "models"
    data_dir.mkdir()
    copy_demo_model(models_dir)
    port = free_port()
    engine = Running(["engine"], entrypoint_env(data_dir))
    try:
        engine.wait_for(lambda line: "waiting for the console to hand over a profile" in line, 10)
        time.sleep(1.0)  # still waiting: no engine yet
        assert engine.proc.poll() is None and engine.argv()[0] == "sh"
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)

        # The console's docker driver writes the handoff, the same code path as a real start.
        settings = load_settings({"FLASHGATE_DATA_DIR": str(data_dir), "FLASHGATE_MODELS_DIR": str(models_dir)})
        command = _cpu_demo_command(settings.models_dir, port)
        DockerDriver(settings)._hand_over(command)

        ready = engine.wait_for(lambda line: line.startswith("engine ready:"), BOOT_TIMEOUT_S)
        assert "context_len=4096" in ready and "max_num_seqs=4" in ready
        info = httpx.get(f"http://127.0.0.1:{port}/server_info", timeout=10).json()
        assert info["build"] == BUILD and info["served_model_name"] == "cpu-demo"
        assert info["config"]["context_length"] == 4096 and info["config"]["max_num_seqs"] == 4
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200
        # The same process became the engine; the handoff was claimed, so a restart waits for a new one.
        assert engine.argv()[1:4] == ["-m", "engine", "serve"] and engine.argv()[4:] == [*command.args, ""]
        assert not settings.engine_handoff_path.exists()
        claimed = json.loads((data_dir / "engine-profile.claimed.json").read_text())
        assert claimed["run"] == 7 and claimed["args"] == command.args
        assert any(
            "run 7, profile 'cpu-demo': CUDA_DEVICE_ORDER=PCI_BUS_ID python -m engine serve" in line
            for line in engine.lines
        )
        environ = Path(f"/proc/{engine.proc.pid}/environ").read_text().split("\0")
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in environ and f"FLASHGATE_DATA_DIR={data_dir}" in environ
    finally:
        code = engine.stop()
    assert code == 0, "\n".join(engine.lines)


def test_engine_mode_stops_at_once_while_waiting(tmp_path):
    engine = Running(["engine"], entrypoint_env(tmp_path / "data"))
    try:
        engine.wait_for(lambda line: "waiting for the console" in line, 10)
        started = time.monotonic()
    finally:
        code = engine.stop(timeout=5)
    assert code == 0 and time.monotonic() - started < 3


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"version": 2, "args": []}, "is not a version 1 engine profile handoff"),
        ({"version": 1, "args": "--model x"}, "has no argument list"),
        ({"version": 1, "args": [], "env": {"CUDA_VISIBLE_DEVICES": 0}}, "an environment that is not names to strings"),
        ("{not json", "cannot read the engine profile"),
    ],
)
def test_engine_mode_refuses_a_bad_handoff(tmp_path, payload, message):
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    handoff = data_dir / "engine-profile.json"
    handoff.write_text(payload if isinstance(payload, str) else json.dumps(payload))
    result = subprocess.run(
        ["sh", str(ENTRYPOINT), "engine"], env=entrypoint_env(data_dir), capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1 and message in result.stderr


def test_arguments_and_other_commands(tmp_path):
    env = entrypoint_env(tmp_path / "data")
    for mode in ("console", "engine"):
        refused = subprocess.run(["sh", str(ENTRYPOINT), mode, "--port", "1"], env=env, capture_output=True, text=True)
        assert refused.returncode == 2 and "takes no arguments" in refused.stderr
    other = subprocess.run(["sh", str(ENTRYPOINT), "echo", "hello"], env=env, capture_output=True, text=True)
    assert other.returncode == 0 and other.stdout == "hello\n"


def test_make_run_starts_the_console_through_the_entrypoint():
    planned = subprocess.run(
        ["make", "--no-print-directory", "-n", "run"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert planned.splitlines()[-1] == "FLASHGATE_PYTHON=.venv/bin/python sh bin/flashgate console"
