"""The agent route: `/v1/*` with an agent key, streamed to and from the engine that holds the production role, under
one served-model alias.

An agent never reaches another profile: while a switch, a qualification run or a restart holds the engine, or the
engine that runs is not production's, the route answers 503 with `Retry-After` and no engine is asked. A budget is
clamped to the production profile's `max_output_tokens`. Streams pass event by event (never buffered whole); if the
engine dies mid-stream, the agent gets an error event and the stream's end, never a silently cut answer.

What one request may cost the console is bounded by the serving engine's own limits: a body larger than its context
could hold is refused (413) before it is read, from its declared length or as it streams in; and the route holds at
most as many agent requests as the engine admits (`max_num_seqs` running on each data-parallel GPU, plus
`max_waiting_requests` waiting), so beyond that the route itself answers 429 with `Retry-After` instead of queueing
connections.

The console's own callers (the switch smoke, the production watch's canary) take the same path with an internal
credential that lives in this process only; they may name the profile they expect (a switch smokes its target
before it holds the production role).
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field
from hmac import compare_digest
from typing import Any

import anyio
import anyio.to_thread
import httpx
import structlog
from litestar.exceptions import HTTPException
from sqlalchemy import Engine
from sqlmodel import Session, select

from app.engine_control.slot import EngineSlot
from app.engine_control.supervisor import Supervisor
from app.profiles.models import Profile
from app.profiles.roles import route_row
from app.route.clamp import BudgetError, clamp
from app.route.service import UsageBook, key_for_secret
from app.settings import Settings

log = structlog.get_logger(__name__)

MODELS = "/v1/models"
PROFILE_HEADER = "x-flashgate-profile"
# The console's own callers, each with its credential.
SWITCH_SMOKE = "switch smoke"
WATCH_CANARY = "production watch"
CONNECT_TIMEOUT_S = 5.0
USAGE_FLUSH_S = 5.0
RESPONSES_TERMINAL = {"response.completed", "response.incomplete", "response.failed"}
# A request body's bytes per token of the context, and a fixed allowance (tools, schemas, the JSON around them): a
# conversation as JSON takes about 4 bytes a token, 9 for CJK text with \u escapes; 32 leaves room for any real one.
BODY_BYTES_PER_TOKEN = 32
BODY_BYTES_FIXED = 1 << 20
# The engine refuses JSON nested deeper (engine/server/protocol.py; the planes share no code, a test holds them equal).
MAX_JSON_DEPTH = 64


def body_limit(context_length: int) -> int:
    """The largest request body the route reads for an engine of this context length."""
    return BODY_BYTES_PER_TOKEN * context_length + BODY_BYTES_FIXED


class RouteError(HTTPException):
    """An answer the route gives itself, in the OpenAI error shape (rendered by the route's exception handler)."""

    def __init__(
        self, status: int, message: str, code: str, param: str | None = None, retry_after: int | None = None
    ) -> None:
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        super().__init__(status_code=status, detail=message, headers=headers)
        self.message, self.code, self.param = message, code, param

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error", 404: "not_found_error"}.get(self.status_code)
        kind = kind or ("invalid_request_error" if self.status_code < 500 else "service_unavailable")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Caller:
    name: str
    # None for the console's own callers.
    key_id: int | None


@dataclass(frozen=True)
class Serving:
    """The profile a request goes to and its ready engine."""

    profile: str
    limit: int
    base_url: str
    served_name: str
    build: str | None
    # The engine's own admission limits, as it applied them (/server_info's config).
    context_length: int
    # engine_admits: agent requests the route holds at once, and how that number is made.
    admits: int
    admits_rule: str = "max_num_seqs + max_waiting_requests"


def engine_admits(applied: dict[str, Any], profile: Profile) -> tuple[int, str]:
    """How many requests the engine holds at once, from its applied config (/server_info) or else the profile, and
    the rule in words: max_num_seqs running per replica (data-parallel attention gives each of its
    tensor_parallel_size GPUs a scheduler of its own; tensor-parallel ones share one) plus max_waiting_requests
    waiting, which is one queue."""
    seqs = applied.get("max_num_seqs") or profile.max_num_seqs
    gpus = applied.get("tensor_parallel_size") or profile.tensor_parallel_size
    replicas = max(1, gpus) if (applied.get("attention") or profile.attention) == "data-parallel" else 1
    rule = "max_num_seqs + max_waiting_requests"
    if replicas > 1:
        rule = f"max_num_seqs × {replicas} data-parallel GPUs + max_waiting_requests"
    return seqs * replicas + (applied.get("max_waiting_requests") or 0), rule


@dataclass(frozen=True)
class Body:
    """A request body as it arrives, read only once the route knows how large it may be."""

    chunks: AsyncIterable[bytes]
    declared_length: int | None  # Content-Length, when the client sent one


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes = b""
    # Set for a stream: the events as they come.
    stream: AsyncIterator[bytes] | None = None
    serving: Serving | None = field(default=None, repr=False)


class AgentRoute:
    def __init__(self, settings: Settings, db: Engine, supervisor: Supervisor, slot: EngineSlot) -> None:
        self.settings = settings
        self.alias = settings.route_alias
        self.db = db
        self.supervisor = supervisor
        self.slot = slot
        # Made at each start, never stored or shown: only this process can call as its own callers.
        self._internal = {name: secrets.token_urlsafe(32) for name in (SWITCH_SMOKE, WATCH_CANARY)}
        self.usage = UsageBook(db)
        self._http: httpx.AsyncClient | None = None
        self._agent_requests = 0  # agent requests between admission and their answer's end
        self._loop: asyncio.AbstractEventLoop | None = None
        self._flusher: asyncio.Task | None = None

    async def open(self) -> None:
        """At console start, on the loop that serves requests (the internal calls run on it too)."""
        self._loop = asyncio.get_running_loop()
        timeout = httpx.Timeout(CONNECT_TIMEOUT_S, read=self.settings.route_read_timeout_s)
        # No pool limit of its own: the route bounds what it holds by the engine's admission limits (`_admit`).
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._http = httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)
        self._flusher = asyncio.create_task(self._flush_usage())

    async def close(self) -> None:
        if self._flusher is not None:
            self._flusher.cancel()
        await anyio.to_thread.run_sync(self.usage.flush)
        if self._http is not None:
            await self._http.aclose()

    async def _flush_usage(self) -> None:
        while True:
            await asyncio.sleep(USAGE_FLUSH_S)
            try:
                await anyio.to_thread.run_sync(self.usage.flush)
            except Exception:  # a busy database loses nothing but this flush's tallies; keep counting
                log.exception("route_usage_flush_failed")

    def _unavailable(self, message: str, code: str = "unavailable") -> RouteError:
        return RouteError(503, message, code, retry_after=self.settings.route_retry_after_s)

    # Who calls, and where it goes

    def authenticate(self, authorization: str | None) -> Caller:
        scheme, _, secret = (authorization or "").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            raise RouteError(
                401, "an agent key is required: send 'Authorization: Bearer <key>' (POST /api/keys makes one)", "no_key"
            )
        for name, internal in self._internal.items():
            if compare_digest(secret, internal):
                return Caller(name, None)
        key = key_for_secret(self.db, secret)
        if key is None:
            raise RouteError(
                401,
                "unknown or revoked agent key; operator tokens do not work here (agent keys come from POST /api/keys)",
                "invalid_key",
            )
        return Caller(key.name, key.id)

    def _profile(self, expected: str | None) -> Profile:
        """Production's profile, or for the console's own callers the one they expect."""
        with Session(self.db) as session:
            if expected is not None:
                return session.exec(select(Profile).where(Profile.name == expected)).one()
            route = route_row(session)
            if route is None or route.production_id is None:
                raise RouteError(
                    503, "no profile holds the production role yet: an operator promotes one", "no_production"
                )
            return session.get(Profile, route.production_id)

    def _serving(self, profile: Profile, agent: bool) -> Serving:
        if agent and (holder := self.slot.holder) is not None:
            raise self._unavailable(f"the route is paused while {holder.what} holds the engine", "switching")
        live = self.supervisor.target()
        if live is None:
            raise self._unavailable(f"the engine of {profile.name!r} is not ready (starting, restarting or stopped)")
        if live.profile != profile.name:
            raise self._unavailable(f"the engine runs {live.profile!r}, not {profile.name!r}: nothing else serves")
        applied = live.server_info.get("config") or {}
        admits, rule = engine_admits(applied, profile)
        return Serving(
            profile.name,
            profile.max_output_tokens,
            live.base_url,
            live.server_info["served_model_name"],
            live.server_info.get("build"),
            context_length=applied.get("context_length") or profile.context_length,
            admits=admits,
            admits_rule=rule,
        )

    def _admit(self, serving: Serving) -> Callable[[], None]:
        """Count an agent request in until the returned release is called; 429 when the engine admits no more."""
        if self._agent_requests >= serving.admits:
            raise RouteError(
                429,
                f"the route holds {self._agent_requests} requests for {serving.profile!r}, as many as its engine "
                f"admits ({serving.admits_rule} = {serving.admits}): retry later",
                "route_full",
                retry_after=self.settings.route_retry_after_s,
            )
        self._agent_requests += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._agent_requests -= 1

        return release

    @staticmethod
    async def _read(body: bytes | Body, limit: int) -> bytes:
        """The whole body, refused (413) once it is known to pass `limit` bytes: from its declared length before a
        byte is read, else as it streams in."""
        if isinstance(body, bytes):
            return body
        too_large = RouteError(
            413,
            f"the request body is larger than {limit} bytes, the most this engine's context could use "
            f"({BODY_BYTES_PER_TOKEN} bytes a token of context_length, plus {BODY_BYTES_FIXED})",
            "request_too_large",
        )
        if body.declared_length is not None and body.declared_length > limit:
            raise too_large
        parts, size = [], 0
        async for chunk in body.chunks:
            size += len(chunk)
            if size > limit:
                raise too_large
            parts.append(chunk)
        return b"".join(parts)

    # Serving

    async def serve(
        self, authorization: str | None, method: str, endpoint: str, body: bytes | Body, expected: str | None = None
    ) -> Answer:
        """One request through the route; a RouteError is the answer when the route refuses it. `expected` is for
        the console's own callers (see `call`), which the admission bound does not count."""
        started = time.monotonic()
        caller = await anyio.to_thread.run_sync(self.authenticate, authorization)
        profile = ""
        release: Callable[[], None] = lambda: None

        def done(ok: bool) -> None:
            release()
            self._record(caller, profile, ok, started)

        try:
            chosen = await anyio.to_thread.run_sync(self._profile, expected)
            profile = chosen.name
            serving = await anyio.to_thread.run_sync(self._serving, chosen, expected is None)
            if expected is None:
                release = self._admit(serving)
            raw = await self._read(body, body_limit(serving.context_length))
            answer = await self._forward(serving, method, endpoint, raw, done)
        except RouteError:
            done(False)
            raise
        except BaseException:  # the client went away, or the console stops: the request no longer counts
            release()
            raise
        if answer.stream is None:
            done(200 <= answer.status < 300)
        return answer

    def _record(self, caller: Caller, profile: str, ok: bool, started: float) -> None:
        self.usage.add(caller.key_id, caller.name, profile, ok, time.monotonic() - started)

    def _prepare(self, serving: Serving, endpoint: str, raw: bytes) -> tuple[bytes, str | None]:
        """The request as the engine gets it: the alias swapped for the engine's served name, the budget clamped."""
        try:
            body = json.loads(raw)
        except RecursionError as exc:  # past Python's reader (~1,000 levels), so past the engine's limit too
            message = f"the request body nests deeper than {MAX_JSON_DEPTH} levels, the engine's limit"
            raise RouteError(400, message, "invalid_json") from exc
        except ValueError as exc:
            raise RouteError(400, f"the request body is not valid JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise RouteError(400, "the request body must be a JSON object", "invalid_request_body")
        model = body.get("model")
        if model is not None and model != self.alias:
            raise RouteError(
                404, f"model {model!r} is not served here; the route serves {self.alias!r}", "model_not_found", "model"
            )
        try:
            clamped = clamp(endpoint, body, serving.limit)
        except BudgetError as exc:
            raise RouteError(400, str(exc), "invalid_budget", exc.field) from exc
        try:
            return json.dumps({**clamped.body, "model": serving.served_name}).encode(), clamped.warning
        except RecursionError as exc:
            raise RouteError(400, "the request body cannot be passed on as JSON", "invalid_json") from exc

    async def _forward(
        self, serving: Serving, method: str, endpoint: str, raw: bytes, done: Callable[[bool], None]
    ) -> Answer:
        content, warning = (None, None)
        if method == "POST":  # parsing a large body takes a while: off the event loop
            content, warning = await anyio.to_thread.run_sync(self._prepare, serving, endpoint, raw)
        request = self._http.build_request(
            method,
            serving.base_url + endpoint,
            content=content,
            headers={"content-type": "application/json"} if content else None,
        )
        try:
            response = await self._http.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._unavailable(f"the engine of {serving.profile!r} did not answer: {type(exc).__name__}") from exc
        headers = {PROFILE_HEADER: serving.profile}
        if warnings := [w for w in (response.headers.get("warning"), warning) if w]:
            headers["warning"] = ", ".join(warnings)
        if retry := response.headers.get("retry-after"):
            headers["retry-after"] = retry
        kind = response.headers.get("content-type", "application/json")
        if response.status_code == 200 and kind.startswith("text/event-stream"):
            headers |= {"content-type": kind, "cache-control": "no-cache"}
            relay = self._relay(response, endpoint, done)
            # A stream whose client goes away before its first event is asked for never runs the relay, nor so its
            # cleanup: when it is dropped unread, the request still leaves the route's count.
            weakref.finalize(relay, self._dropped_unread, response, done)
            return Answer(200, headers, stream=relay, serving=serving)
        try:
            data = await response.aread()
        except httpx.HTTPError as exc:
            raise self._unavailable(f"the engine of {serving.profile!r} broke off its answer: {exc}") from exc
        finally:
            await response.aclose()
        if response.status_code == 200:
            payload = json.loads(data)
            data = json.dumps(self._models(payload, serving) if endpoint == MODELS else self._renamed(payload)).encode()
        return Answer(response.status_code, headers | {"content-type": kind}, body=data, serving=serving)

    def _renamed(self, payload: dict[str, Any]) -> dict[str, Any]:
        """An answer (or stream event) of the engine's as the alias's."""
        if "model" in payload:
            payload["model"] = self.alias
        if isinstance(payload.get("response"), dict) and "model" in payload["response"]:
            payload["response"]["model"] = self.alias
        return payload

    def _models(self, payload: dict[str, Any], serving: Serving) -> dict[str, Any]:
        """/v1/models: the alias alone, its output limit the route's clamp."""
        entry = next(iter(payload.get("data") or []), {})
        most = min(serving.limit, entry.get("max_output_tokens") or serving.limit)
        capabilities = {**entry.get("capabilities", {}), "max_output_tokens": most}
        model = {k: v for k, v in entry.items() if k != "root"}  # the weights' path is the profile's business
        model |= {"id": self.alias, "owned_by": "flashgate", "max_output_tokens": most, "capabilities": capabilities}
        return {"object": "list", "data": [model]}

    def _dropped_unread(self, response: httpx.Response, done: Callable[[bool], None]) -> None:
        if response.is_closed:  # the relay ran and closed it, and said when it was done
            return
        done(False)
        self._loop.call_soon_threadsafe(lambda: self._loop.create_task(response.aclose()))

    async def _relay(
        self, response: httpx.Response, endpoint: str, done: Callable[[bool], None]
    ) -> AsyncIterator[bytes]:
        """The engine's events, whole and renamed, as they come. If the engine breaks off before the stream's end,
        the agent gets an error event and the end of the stream."""
        pending, ended, failure, last = b"", False, None, {}
        errored = False
        try:
            try:
                async for chunk in response.aiter_bytes():
                    pending += chunk
                    *events, pending = pending.split(b"\n\n")
                    relayed = []
                    for event in filter(bytes.strip, events):
                        lines = []
                        for line in event.decode().split("\n"):
                            if line == "data: [DONE]":
                                ended = True
                            elif line.startswith("data: {"):
                                last = self._renamed(json.loads(line[6:]))
                                ended = ended or last.get("type") in RESPONSES_TERMINAL
                                errored = errored or bool(last.get("error")) or last.get("type") == "response.failed"
                                line = "data: " + json.dumps(last, ensure_ascii=False)
                            lines.append(line)
                        relayed.append("\n".join(lines) + "\n\n")
                    if relayed:
                        yield "".join(relayed).encode()
                if not ended:
                    failure = "the engine's stream ended before its last event"
            except httpx.HTTPError as exc:
                failure = f"the engine broke off the stream ({type(exc).__name__}: {exc})"
            if failure is not None:
                log.warning("route_stream_broken", endpoint=endpoint, error=failure)
                yield self._stream_error(endpoint, failure, last)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()
            done(failure is None and not errored)

    def _stream_error(self, endpoint: str, message: str, last: dict[str, Any]) -> bytes:
        """The stream's error event and its end, as each API ends a failed stream."""
        message += "; the answer is incomplete"
        if endpoint == "/v1/responses":
            response = dict(last.get("response") or {}) | {
                "object": "response",
                "model": self.alias,
                "status": "failed",
                "error": {"code": "server_error", "message": message},
            }
            event = {"type": "response.failed", "response": response}
            if "sequence_number" in last:
                event["sequence_number"] = last["sequence_number"] + 1
            return f"event: response.failed\ndata: {json.dumps(event)}\n\n".encode()
        error = {"error": {"message": message, "type": "server_error", "param": None, "code": "engine_unavailable"}}
        return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()

    # The console's own calls

    def call(self, caller: str, profile: str, endpoint: str, body: dict[str, Any], timeout_s: float) -> Answer:
        """A whole (non-streamed) request through the route from another thread, as `caller` (SWITCH_SMOKE or
        WATCH_CANARY), to `profile`. Raises RouteError when the route refuses, TimeoutError past `timeout_s`."""
        if self._loop is None:
            raise RuntimeError("the route is not open yet")
        authorization = f"Bearer {self._internal[caller]}"
        coroutine = self.serve(authorization, "POST", endpoint, json.dumps(body).encode(), expected=profile)
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise
