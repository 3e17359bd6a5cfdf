"""The HTTP API (Litestar): the OpenAI-compatible endpoints (chat completions, completions, the Responses API's
stateless subset), /health, /server_info and /metrics.

Generation requests are parsed, checked and tokenized off the event loop (the tokenizer releases the GIL, so neither
the loop nor the engine's thread waits for a long prompt), then handed to the engine loop; a whole response
waits for the request's last output, a stream sends each as server-sent events ending in `data: [DONE]`. A client
that goes away, mid-stream or while waiting, aborts its request at once, which frees its KV pages.
"""

from __future__ import annotations

import asyncio
import functools
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import structlog
from litestar import Litestar, MediaType, Request, Response, get, post
from litestar.exceptions import HTTPException
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST

from engine.llm_engine import RequestOutput
from engine.server.completions import ChatFormatter, CompletionFormatter
from engine.server.engine_loop import EngineLoop, RequestFailed, RequestStream
from engine.server.grammar import Grammars
from engine.server.metrics import Metrics
from engine.server.protocol import (
    ApiError,
    GenerationRequest,
    Limits,
    body_bytes_limit,
    parse_body,
    parse_chat,
    parse_completion,
)
from engine.server.responses_api import ResponsesFormatter, parse_responses
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)
RETRY_AFTER_S = "1"


@dataclass
class Served:
    """What the handlers serve from; `accepting` turns off on SIGTERM."""

    loop: EngineLoop
    metrics: Metrics
    tokenizer: Tokenizer
    limits: Limits
    max_waiting_requests: int
    server_info: dict[str, Any]
    models: dict[str, Any]
    grammars: Grammars | None  # None: the tokenizer cannot be constrained (not byte-level)
    accepting: bool = True


def create_app(served: Served) -> Litestar:
    loop, limits = served.loop, served.limits
    max_body_bytes = body_bytes_limit(limits, served.tokenizer)

    def check_admitting() -> None:
        if loop.failure is not None:
            raise ApiError(503, "the engine failed and is shutting down", code="engine_failed")
        if not served.accepting:
            raise ApiError(503, "the server is shutting down", code="draining", headers={"Retry-After": RETRY_AFTER_S})

    @get("/health", sync_to_thread=False)
    def health() -> Response:
        ok = served.accepting and loop.failure is None
        return Response({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @get("/v1/models", sync_to_thread=False)
    def models() -> dict[str, Any]:
        return served.models

    @get("/server_info", sync_to_thread=False)
    def server_info() -> dict[str, Any]:
        return served.server_info

    @get("/metrics", sync_to_thread=False)
    def metrics() -> Response:
        return Response(served.metrics.render(loop.stats), media_type=CONTENT_TYPE_LATEST)

    async def generate(
        request: Request, parse: Callable[..., GenerationRequest], formatter: type, prefix: str
    ) -> Response | Stream:
        check_admitting()
        raw = await request.body()
        # Long bodies parse, long prompts tokenize, and output grammars compile, slowly: off the event loop.
        generation = await asyncio.to_thread(lambda: parse(parse_body(raw)))
        if (waiting := loop.num_waiting) >= served.max_waiting_requests:
            raise ApiError(
                429,
                f"{waiting} requests are waiting; max_waiting_requests is {served.max_waiting_requests}",
                code="queue_full",
                headers={"Retry-After": RETRY_AFTER_S},
            )
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        headers = {"Warning": generation.warning} if generation.warning else {}
        stream = loop.submit(request_id, generation.prompt_ids, generation.params)
        fmt = formatter(request_id, limits.served_model_name, generation, served.tokenizer)
        if generation.stream:
            events = _sse(stream, fmt, loop)
            return Stream(events, media_type="text/event-stream", headers=headers | {"Cache-Control": "no-cache"})
        output = await _final_output(stream, request, loop)
        if output.finish_reason == "timeout":
            timeout = loop.request_timeout_s
            if not output.token_ids:
                raise ApiError(
                    503,
                    f"the request did not start within request_timeout_s ({timeout} s)",
                    code="timeout",
                    headers={"Retry-After": RETRY_AFTER_S},
                )
            headers["Warning"] = f'299 - "request_timeout_s {timeout} reached: the output is cut"'
        return Response(fmt.response(output), headers=headers)

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(request: Request) -> Response | Stream:
        parse = functools.partial(parse_chat, tokenizer=served.tokenizer, limits=limits, grammars=served.grammars)
        return await generate(request, parse, ChatFormatter, "chatcmpl")

    @post("/v1/completions", status_code=200)
    async def completions(request: Request) -> Response | Stream:
        parse = functools.partial(parse_completion, tokenizer=served.tokenizer, limits=limits)
        return await generate(request, parse, CompletionFormatter, "cmpl")

    @post("/v1/responses", status_code=200)
    async def responses(request: Request) -> Response | Stream:
        parse = functools.partial(parse_responses, tokenizer=served.tokenizer, limits=limits, grammars=served.grammars)
        return await generate(request, parse, ResponsesFormatter, "resp")

    def http_error(request: Request, error: HTTPException) -> Response:
        if error.status_code == 413:
            message = (
                f"the request body is larger than {max_body_bytes} bytes, the most a prompt of context_length "
                f"{limits.context_length} tokens takes as JSON"
            )
            return _api_error(request, ApiError(413, message, code="request_too_large"))
        return _http_error(request, error)

    return Litestar(
        route_handlers=[health, models, server_info, metrics, chat_completions, completions, responses],
        exception_handlers={ApiError: _api_error, HTTPException: http_error, Exception: _unexpected_error},
        request_max_body_size=max_body_bytes,
        openapi_config=None,
        logging_config=None,
    )


async def _final_output(stream: RequestStream, request: Request, loop: EngineLoop) -> RequestOutput:
    """The request's finished output; if the client disconnects first, the request is aborted."""

    async def last() -> RequestOutput:
        async for output in stream:
            if output.finished:
                return output
        raise AssertionError("a request stream ended without a finished output")

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    result, gone = asyncio.ensure_future(last()), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({result, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():  # the client went away, or the server is stopping this handler
            result.cancel()
            loop.abort(stream.request_id)
    if not result.done():
        raise ApiError(499, "the client closed the request", code="client_closed")
    try:
        return result.result()
    except RequestFailed as failure:
        raise ApiError(failure.status, failure.message, code="request_failed") from failure


async def _sse(stream: RequestStream, fmt: Any, loop: EngineLoop) -> AsyncIterator[str]:
    try:
        for payload in fmt.opening():
            yield fmt.sse(payload)
        async for output in stream:
            for payload in fmt.events(output):
                yield fmt.sse(payload)
    except RequestFailed as failure:
        for payload in fmt.failed(failure.status, failure.message):
            yield fmt.sse(payload)
    finally:
        if not stream.finished:  # the client went away mid-stream
            loop.abort(stream.request_id)
    if closing := fmt.closing():
        yield closing


def _api_error(_: Request, error: ApiError) -> Response:
    if error.status >= 500 or error.status == 429:
        log.warning("request_refused", status=error.status, code=error.code, message=error.message)
    return Response(error.body(), status_code=error.status, headers=error.headers, media_type=MediaType.JSON)


def _http_error(request: Request, error: HTTPException) -> Response:
    code = {404: "not_found", 405: "method_not_allowed"}.get(error.status_code)
    return _api_error(
        request, ApiError(error.status_code, f"{error.detail} ({request.method} {request.url.path})", code=code)
    )


def _unexpected_error(request: Request, error: Exception) -> Response:
    # A bug: its traceback goes to the log, not to the client.
    log.exception("request_failed", path=request.url.path, error=repr(error))
    message = f"internal error ({type(error).__name__}); the engine's log has it as request_failed"
    return _api_error(request, ApiError(500, message, code="internal_error"))
