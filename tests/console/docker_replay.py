"""A tiny HTTP server on loopback that replays recorded Docker Engine API exchanges (docker_api/*.json) for the docker
driver's tests, where no daemon runs. The exchanges are keyed by the container's state, and a recorded `then` moves
it (start → running, stop → exited); a test can put the container in a recorded state itself (`crashed`: killed
under it). Every request is kept, so a test can check what the console asked, and that it asked nothing unrecorded
(creating a container, say)."""

from __future__ import annotations

import json
import re
import struct
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

RECORDINGS = Path(__file__).parent / "docker_api"


@dataclass(frozen=True)
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    state: str
    status: int


def _frames(stream: list[list[Any]]) -> bytes:
    """A non-TTY container's log body: each chunk behind an 8-byte header (stream id, 3 zero bytes, length)."""
    body = b""
    for stream_id, text in stream:
        data = (text + "\n").encode()
        body += struct.pack(">BxxxL", stream_id, len(data)) + data
    return body


class DockerReplay:
    def __init__(self, recording: str = "engine_container.json") -> None:
        spec = json.loads((RECORDINGS / recording).read_text())
        self.container = spec["container"]
        self.state = spec["initial_state"]
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        # By name only: the socket proxy lets the console reach the engine container by its name and nothing else
        # (deploy/docker-proxy/haproxy.cfg), so a call by id is refused there as it is here.
        refs = re.escape(self.container["name"])
        self._exchanges = [
            (
                x["state"],
                x["request"]["method"],
                re.compile("^" + re.escape(x["request"]["path"]).replace(r"\{container\}", f"(?:{refs})") + "$"),
                x["response"],
                x.get("then"),
            )
            for x in spec["exchanges"]
        ]
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def base_url(self) -> str:
        return f"tcp://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self) -> DockerReplay:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set_state(self, state: str) -> None:
        with self._lock:
            self.state = state

    def calls(self, method: str, suffix: str) -> list[Seen]:
        return [s for s in self.seen if s.method == method and s.path.endswith(suffix)]

    def unrecorded(self) -> list[Seen]:
        return [s for s in self.seen if s.status == 404]

    def _answer(self, method: str, target: str) -> tuple[int, dict[str, str], bytes]:
        url = urlsplit(target)
        unrecorded = {"status": 404, "json": {"message": f"no recorded exchange for {method} {url.path}"}}
        with self._lock:
            state = self.state
            response, then = next(
                (
                    (response, then)
                    for when, wanted, pattern, response, then in self._exchanges
                    if wanted == method and when in ("*", state) and pattern.match(url.path)
                ),
                (unrecorded, None),
            )
            if then is not None:
                self.state = then
            self.seen.append(Seen(method, url.path, parse_qs(url.query), state, response["status"]))
        headers = dict(response.get("headers", {}))
        if "json" in response:
            body = json.dumps(response["json"]).encode()
            headers.setdefault("Content-Type", "application/json")
        elif "stream" in response:
            body = _frames(response["stream"])
        else:
            body = b""
        return response["status"], headers, body

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _reply(self) -> None:
                if length := int(self.headers.get("Content-Length") or 0):
                    self.rfile.read(length)
                status, headers, body = replay._answer(self.command, self.path)
                self.send_response(status)
                for name, value in {**headers, "Api-Version": "1.47", "Content-Length": str(len(body))}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_DELETE = do_PUT = _reply

            def log_message(self, *args: object) -> None:
                pass

        return Handler
