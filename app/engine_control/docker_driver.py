"""The `docker` driver: a pre-created engine container, driven through the Docker SDK via a filtering socket proxy.

The console never creates containers (the Docker socket is root-equivalent): it only starts, stops, restarts,
inspects and reads the logs of the one container compose made, and hands the profile over as a file on the shared
data volume that the engine's entrypoint reads. A kill is a stop with no grace, so the proxy needs nothing more.
Every call names the container by its name, which is what the proxy filters on (deploy/docker-proxy/haproxy.cfg).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import docker
from docker.errors import DockerException, NotFound

from app.db import utcnow
from app.engine_control.driver import DriverError, EngineCommand, EngineHandle
from app.engine_control.preflight import Check, CheckStatus
from app.settings import Settings

ALL_INTERFACES = "0.0.0.0"
HANDOFF_VERSION = 1


class EngineContainer:
    """The engine container, addressed by its name in every call. The SDK's Container objects address a container by
    its id, which the socket proxy cannot know in advance: it lets the console reach this one name and nothing
    else."""

    def __init__(self, api: docker.APIClient, name: str) -> None:
        self.api, self.name = api, name
        self.attrs: dict = {}

    @property
    def short_id(self) -> str:
        return self.attrs["Id"][:12]

    def reload(self) -> None:
        self.attrs = self.api.inspect_container(self.name)

    def start(self) -> None:
        self.api.start(self.name)

    def stop(self, timeout: int) -> None:
        self.api.stop(self.name, timeout=timeout)

    def logs(self, **options) -> Iterator[bytes]:
        return self.api.logs(self.name, **options)


class DockerHandle:
    pid = None

    def __init__(self, container: EngineContainer, since: int, log_path: Path) -> None:
        self.docker_container = container
        self.container = f"{container.name} ({container.short_id})"
        self.since = since
        self.log_path = log_path

    def _stream(self) -> Iterator[str]:
        stream = self.docker_container.logs(stream=True, follow=True, stdout=True, stderr=True, since=self.since)
        pending = b""
        try:
            for chunk in stream:
                pending += chunk
                *complete, pending = pending.split(b"\n")
                for line in complete:
                    yield line.decode(errors="replace")
        except DockerException:
            pass  # the log stream ends with the container; exit_code() tells why
        if pending:
            yield pending.decode(errors="replace")

    def lines(self) -> Iterator[str]:
        """The container's log stream, copied into the run's log file as it comes."""
        with self.log_path.open("a", encoding="utf-8") as log:
            for line in self._stream():
                log.write(line + "\n")
                log.flush()
                yield line

    def exit_code(self) -> int | None:
        try:
            self.docker_container.reload()
        except DockerException:
            return None  # the proxy did not answer: unknown, and the supervisor's /health watch still runs
        state = self.docker_container.attrs["State"]
        return None if state["Running"] else state["ExitCode"]

    def terminate(self, grace_s: float) -> int | None:
        # Docker sends the container's stop signal (SIGTERM), waits `t` seconds, then SIGKILL.
        try:
            self.docker_container.stop(timeout=math.ceil(grace_s))
            self.docker_container.reload()
        except DockerException as exc:
            raise DriverError(f"could not stop container {self.container}: {exc}") from exc
        return self.docker_container.attrs["State"]["ExitCode"]


class DockerDriver:
    name = "docker"
    bind_host = ALL_INTERFACES

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.base_url = f"http://{settings.docker_engine_host}:{settings.engine_port}"
        self._client: docker.APIClient | None = None

    def _container(self) -> EngineContainer:
        where = f"the Docker socket proxy at {self.settings.docker_host} (FLASHGATE_DOCKER_HOST)"
        try:
            if self._client is None:
                self._client = docker.APIClient(base_url=self.settings.docker_host, timeout=10)
            container = EngineContainer(self._client, self.settings.docker_container)
            container.reload()
            return container
        except NotFound as exc:
            raise DriverError(
                f"no container named {self.settings.docker_container!r} (FLASHGATE_DOCKER_CONTAINER): compose "
                f"creates it; the console never does"
            ) from exc
        except DockerException as exc:
            raise DriverError(f"could not reach {where}: {exc}") from exc

    def preflight(self) -> list[Check]:
        try:
            container = self._container()
        except DriverError as exc:
            return [Check("container", CheckStatus.fail, str(exc))]
        return [Check("container", CheckStatus.ok, f"container {container.name} ({container.short_id}) found")]

    def _hand_over(self, command: EngineCommand) -> None:
        """Write the profile where the engine's entrypoint reads it; replaced atomically, never half-written."""
        path: Path = self.settings.engine_handoff_path
        payload = {
            "version": HANDOFF_VERSION,
            "run": command.run_id,
            "profile": command.profile,
            "content_hash": command.content_hash,
            "args": command.args,
            # Set on top of the container's environment by its entrypoint (bin/flashgate): the profile's GPUs.
            "env": command.env,
        }
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(partial, path)

    def launch(self, command: EngineCommand, log_path: Path) -> EngineHandle:
        container = self._container()
        self._hand_over(command)
        try:
            container.reload()
            if container.attrs["State"]["Running"]:
                # Started outside the console: it would hold the GPUs and read an old profile.
                container.stop(timeout=math.ceil(self.settings.engine_grace_s))
            since = int(utcnow().timestamp())
            container.start()
        except DockerException as exc:
            raise DriverError(f"could not start container {container.name}: {exc}") from exc
        return DockerHandle(container, since, log_path)

    def reclaim(self, pid: int | None, container: str | None, grace_s: float) -> str:
        try:
            found = self._container()
            found.reload()
            if not found.attrs["State"]["Running"]:
                return f"container {found.name} is not running"
            found.stop(timeout=math.ceil(grace_s))
        except (DriverError, DockerException) as exc:
            return f"the container could not be checked: {exc}"
        return f"container {found.name} was still running and was stopped"
