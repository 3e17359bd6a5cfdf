"""The container tests: the image built for real (`make image-cpu`: the Debian 12 base, the wheelhouse, no network
in the build) and the compose stack run on a real Docker daemon with exactly the operators' CPU file set
(compose.yaml alone), published on loopback only. Without a daemon they skip, except under CI, where they fail:
.ci/run starts one."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.support import copy_demo_model, free_port

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "flashgate:local"
ADMIN_TOKEN = "fg_container-test-admin"


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 120, check: bool = True) -> str:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(args)} exited with {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def compose_command() -> list[str]:
    """Today's compose plugin where there is one, else compose 1.29 (Debian's docker-compose): the file sets are
    written for both."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    assert shutil.which("docker-compose"), "neither `docker compose` nor docker-compose is installed"
    return ["docker-compose"]


@pytest.fixture(scope="session")
def docker_daemon() -> None:
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if os.environ.get("CI"):
            pytest.fail("CI is set but no Docker daemon answers: .ci/run starts one (dockerd as root)")
        pytest.skip("no Docker daemon answers (`sudo dockerd`, or see .ci/run)")


@pytest.fixture(scope="session")
def image(docker_daemon, request) -> str:
    """The appliance image, built as CI builds it; its build time and size go to the terminal summary."""
    started = time.monotonic()
    _run("make", "image-cpu", f"IMAGE={IMAGE}", timeout=1500)
    seconds = time.monotonic() - started
    size = int(_run("docker", "image", "inspect", "--format", "{{.Size}}", IMAGE).strip())
    plugins = request.config.pluginmanager
    # Past pytest's output capture, so that CI's log shows it whether the tests pass or not.
    with plugins.get_plugin("capturemanager").global_and_fixture_disabled():
        plugins.get_plugin("terminalreporter").write_line(
            f"\nimage {IMAGE}: built in {seconds:.0f} s (make image-cpu), {size / 1e9:.2f} GB"
        )
    return IMAGE


class Stack:
    """One compose project of the operators' file set, addressed on loopback."""

    def __init__(self, project: str, files: list[str], profiles: list[str], env: dict[str, str], url: str) -> None:
        self.project, self.files, self.profiles, self.env, self.url = project, files, profiles, env, url
        self.http = httpx.Client(base_url=url, timeout=60)

    def compose(self, *args: str, timeout: float = 300) -> str:
        options = [arg for name in self.files for arg in ("-f", name)]
        options += [arg for name in self.profiles for arg in ("--profile", name)]
        return _run(*compose_command(), "-p", self.project, *options, *args, env=self.env, timeout=timeout)

    def container(self, service: str) -> str:
        ids = self.compose("ps", "-q", service).split()
        assert len(ids) == 1, f"{service}: {ids}"
        return ids[0]

    def inspect(self, container: str, template: str) -> str:
        return _run("docker", "inspect", "--format", template, container).strip()

    def exec(self, container: str, *command: str, stdin: str | None = None) -> str:
        done = subprocess.run(
            ["docker", "exec", "-i", container, *command], input=stdin, capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, f"{command}: {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def wait_healthy(self, service: str = "flashgate", timeout: float = 180) -> str:
        container = self.container(service)
        wait(
            lambda: self.inspect(container, "{{.State.Health.Status}}") == "healthy",
            f"{service} healthy",
            timeout,
            self,
        )
        return container

    def get(self, path: str) -> dict | list:
        response = self.http.get(path, headers=ADMIN)
        assert response.status_code == 200, response.text
        return response.json()

    def leftovers(self) -> list[str]:
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in ("container", "network", "volume"):
            listing = ["ps", "-a", "-q"] if kind == "container" else [kind, "ls", "-q"]
            found += [f"{kind} {name}" for name in _run("docker", *listing, "--filter", label).split()]
        return found


def _logs(stack: Stack) -> str:
    try:
        return stack.compose("logs", "--no-color", "--tail", "150", timeout=60)
    except AssertionError as exc:
        return str(exc)


ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def wait(predicate: Callable[[], bool], what: str, timeout: float, stack: Stack) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (httpx.HTTPError, AssertionError):
            pass
        time.sleep(1)
    raise AssertionError(f"not {what} within {timeout} s; the stack's logs:\n{_logs(stack)}")


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    """The weights directory an operator mounts: the shipped demo model as `demo` (docs/deploy.md, "A CPU host"),
    readable by the container's user (10001)."""
    models = tmp_path_factory.mktemp("container-models")
    copy_demo_model(models)
    for path in [models, *models.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    models.parent.chmod(0o755)
    return models


def stack_env(models_dir: Path, port: int, **settings: str) -> dict[str, str]:
    """The operator's settings (what a `.env` would hold), on loopback, over this environment."""
    return {
        **os.environ,
        "FLASHGATE_IMAGE": IMAGE,
        "FLASHGATE_PUBLISH": f"127.0.0.1:{port}",
        "FLASHGATE_MODELS_DIR": str(models_dir),
        "FLASHGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        # A CPU host's /dev/shm needs no NCCL-sized segment.
        "FLASHGATE_SHM_SIZE": "1g",
        **settings,
    }


@pytest.fixture(scope="module")
def make_stack(image, models_dir) -> Iterator[Callable[..., Stack]]:
    """Stacks of the operators' file sets; each is taken down with its volume afterwards, and nothing of it may be
    left."""
    made: list[Stack] = []

    def make(project: str, files: list[str], profiles: list[str] = (), **settings: str) -> Stack:
        port = free_port()
        env = stack_env(models_dir, port, **settings)
        stack = Stack(project, files, list(profiles), env, f"http://127.0.0.1:{port}")
        stack.compose("down", "--volumes", "--remove-orphans")  # a run killed before its teardown
        made.append(stack)
        return stack

    yield make
    for stack in made:
        stack.http.close()
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "30")
        assert stack.leftovers() == [], stack.leftovers()
