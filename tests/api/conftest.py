"""The engine as a real subprocess (`python -m engine serve`) on the tiny checkpoint, on a free port, driven by the
official `openai` client; and the offline `LLM` on the same checkpoint as the oracle for greedy outputs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from engine import LLM
from tests.support import ROOT, OutputLines, free_port, terminate

READY = re.compile(
    r"^engine ready: context_len=(?P<context_len>\d+) max_total_num_tokens=(?P<max_total_num_tokens>\d+) "
    r"max_num_seqs=(?P<max_num_seqs>\d+) max_num_batched_tokens=(?P<max_num_batched_tokens>\d+) "
    r"available_gpu_mem=(?P<available_gpu_mem>\d+\.\d+)GiB$"
)
BOOT_TIMEOUT_S = 120
# The flags every test server shares: the offline oracle below runs with the same ones.
DTYPE, CONTEXT_LENGTH = "float32", 1024


class EngineServer:
    """One `python -m engine serve` process: its ready line, its JSON log lines, clients for it, and stop()."""

    def __init__(self, model_dir: Path, log_path: Path, **flags):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        args = {"model": model_dir, "port": self.port, "dtype": DTYPE, "context_length": CONTEXT_LENGTH} | flags
        command = [sys.executable, "-m", "engine", "serve"]
        for name, value in args.items():
            flag = name.replace("_", "-")
            command += (
                [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
            )
        self.log_path = log_path
        # One torch thread: the servers and the test process (the oracle) share the machine's two cores.
        env = {**os.environ, "FLASHGATE_BUILD": "test-build", "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True
        )
        self.output = OutputLines(self.proc, log_path)
        try:
            self.ready_line = self.output.wait_for(lambda line: line.startswith("engine ready:"), BOOT_TIMEOUT_S)
        except AssertionError:
            self.proc.kill()
            raise
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.http = httpx.Client(base_url=self.url, timeout=120)

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
        try:
            return terminate(self.proc, timeout)
        finally:
            self.client.close()
            self.http.close()


@pytest.fixture(scope="session")
def tiny_dir(tiny_models_dir):
    return tiny_models_dir / "tiny"


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
