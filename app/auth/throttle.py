"""Failed credential checks per client address: sign-in and the setup exchange are where tokens get guessed. After
FAILURES failures within WINDOW_S from one address, its attempts answer 429 with `Retry-After` until the oldest
failure is WINDOW_S old. A success does not count, so an operator who types well is never held up. The address is
the TCP peer's: behind a proxy, that is the proxy's, and the limit applies to all its clients together."""

from __future__ import annotations

import math
import threading
import time
from collections import deque

from litestar import Request
from litestar.datastructures import State
from litestar.exceptions import ClientException
from litestar.status_codes import HTTP_429_TOO_MANY_REQUESTS

FAILURES = 10
WINDOW_S = 300.0


class TooManyAttempts(ClientException):
    status_code = HTTP_429_TOO_MANY_REQUESTS


class AttemptLimit:
    def __init__(self, failures: int = FAILURES, window_s: float = WINDOW_S) -> None:
        self.failures, self.window_s = failures, window_s
        self._lock = threading.Lock()
        self._failed: dict[str, deque[float]] = {}

    def _recent(self, client: str, now: float) -> deque[float]:
        failed = self._failed.setdefault(client, deque())
        while failed and now - failed[0] >= self.window_s:
            failed.popleft()
        return failed

    def check(self, client: str) -> None:
        """429 while the client has used up its failures."""
        now = time.monotonic()
        with self._lock:
            failed = self._recent(client, now)
            if len(failed) < self.failures:
                return
            retry_after = math.ceil(self.window_s - (now - failed[0]))
        raise TooManyAttempts(
            f"{self.failures} failed attempts from {client} within {self.window_s:g} s: try again in {retry_after} s",
            headers={"Retry-After": str(retry_after)},
        )

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            self._recent(client, now).append(now)


def provide_attempts(state: State) -> AttemptLimit:
    return state.attempts


def client_address(request: Request) -> str:
    return request.client.host if request.client else "unknown"
