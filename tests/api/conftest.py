"""The engine as a real subprocess (`python -m engine serve`) on the tiny checkpoint, on a free port, driven by the
official `openai` client; and the offline `LLM` on the same checkpoint as the oracle for greedy outputs."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM
from engine.tools.make_tiny import make_tiny

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(
    r"^engine ready: context_len=(?P<context_len>\d+) max_total_num_tokens=(?P<max_total_num_tokens>\d+) "
    r"max_num_seqs=(?P<max_num_seqs>\d+) max_num_batched_tokens=(?P<max_num_batched_tokens>\d+) "
    r"available_gpu_mem=(?P<available_gpu_mem>\d+\.\d+)GiB$"
)
BOOT_TIMEOUT_S = 120
# The flags every test server shares: the offline oracle below runs with the same ones.
DTYPE, CONTEXT_LENGTH = "float32", 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """One `python -m engine serve` process: its ready line, its JSON log lines, clients for it, and stop()."""

    def __init__(self, model_dir: Path, log_path: Path, **flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = {"model": model_dir, "port": self.port, "dtype": DTYPE, "context_length": CONTEXT_LENGTH} | flags
        command = [sys.executable, "-m", "engine", "serve"]
        for name, value in args.items():
            command += [f"--{name.replace('_', '-')}", str(value)]
        self.log_path = log_path
        # One torch thread: the servers and the test process (the oracle) share the machine's two cores.
        env = {**os.environ, "FLASHGATE_BUILD": "test-build", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True
        )
        self.stdout: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_stdout, daemon=True).start()
        self.ready_line = self._wait_ready()
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.url, timeout=120)

    def _read_stdout(self) -> None:
        for line in self.proc.stdout:
            self.stdout.put(line.rstrip("\n"))

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                line = self.stdout.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"the engine exited with {self.proc.returncode}:\n{self.log_path.read_text()}"
                    ) from None
                continue
            if line.startswith("engine ready:"):
                return line
        self.proc.kill()
        raise RuntimeError(f"no ready line within {BOOT_TIMEOUT_S} s:\n{self.log_path.read_text()}")

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def metrics(self) -> dict[str, float]:
        text = self.http.get("/metrics").text
        return {
            name: float(value)
            for name, value in (line.split(" ") for line in text.splitlines() if line and not line.startswith("#"))
        }

    def wait_metric(self, name: str, predicate, timeout: float = 20.0) -> float:
        deadline = time.monotonic() + timeout
        while True:
            value = self.metrics()[name]
            if predicate(value):
                return value
            assert time.monotonic() < deadline, f"{name} stayed at {value}"
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.client.close()
            self.http.close()


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def oracle(tiny_dir):
    """The offline engine with the servers' model flags and an ample pool: greedy outputs without preemption."""
    return LLM(str(tiny_dir), dtype=DTYPE, context_length=CONTEXT_LENGTH)


@pytest.fixture(scope="session")
def start_server(tiny_dir, tmp_path_factory):
    started: list[EngineServer] = []

    def start(**flags) -> EngineServer:
        log_path = tmp_path_factory.mktemp("engine-logs") / "engine.jsonl"
        server = EngineServer(tiny_dir, log_path, **flags)
        started.append(server)
        return server

    yield start
    for server in started:
        if server.proc.poll() is None:
            server.stop()
