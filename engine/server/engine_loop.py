"""The engine's one background thread. It alone touches the LLMEngine: it takes commands (add, abort, stop) from a
thread-safe inbox, runs `step()` while there is work, enforces request timeouts, and hands each request's outputs
to the event loop on that request's asyncio queue. Handlers only submit, abort and read the published stats.

`step()` returns when it has queued the next step on the device, with the outputs of the one before it
(llm_engine.py): delivering them, applying commands and publishing stats run while the device computes. An abort
between steps frees the request's pages at once; the token the device is still computing for it is dropped."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from engine.llm_engine import LLMEngine, RequestOutput
from engine.sampling_params import SamplingParams
from engine.server.metrics import EngineStats, Metrics

log = structlog.get_logger(__name__)


class RequestFailed(Exception):
    """The engine ended a request without finishing it: it failed, or the server shut down."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


class RequestStream:
    """One request's outputs, in order, as the event loop sees them; iteration ends after the finished output and
    raises RequestFailed if the engine gave up on the request."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | RequestFailed] = asyncio.Queue()
        self.finished = False

    def put(self, item: RequestOutput | RequestFailed) -> None:
        """From the engine thread."""
        with contextlib.suppress(RuntimeError):  # a closed event loop: the server is gone, and so is the client
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, RequestFailed):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


@dataclass
class _Tracked:
    stream: RequestStream
    arrival: float
    deadline: float | None
    first_token: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: Metrics, on_failure: Callable[[BaseException], None]):
        self.engine = engine
        self.metrics = metrics
        self.on_failure = on_failure
        self.request_timeout_s = engine.config.request_timeout_s
        self.stats = EngineStats(  # replaced whole, never mutated
            kv_capacity_tokens=engine.kv_capacity_tokens, expert_counts=engine.expert_counts
        )
        self.failure: BaseException | None = None
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._lock = threading.Lock()
        self._unfinished = 0
        self._counts = {"prompt_tokens": 0, "generation_tokens": 0}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop",))
            self._thread.join()

    @property
    def num_unfinished(self) -> int:
        return self._unfinished

    @property
    def num_waiting(self) -> int:
        """Requests beyond the max_num_seqs that run at once: those that wait for a running slot. Counted from the
        requests submitted, not from the scheduler's queue as of the last step, where a burst's requests wait a step
        for the token budget of their prefill (or for their turn) even while a slot is free for each."""
        return max(0, self._unfinished - self.engine.config.max_num_seqs)

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        """From the event loop: queue a request; its outputs arrive on the returned stream."""
        stream = RequestStream(request_id, asyncio.get_running_loop())
        now = time.monotonic()
        deadline = now + self.request_timeout_s if self.request_timeout_s else None
        with self._lock:
            self._unfinished += 1
        self._inbox.put(("add", request_id, prompt_ids, params, _Tracked(stream, now, deadline)))
        return stream

    def abort(self, request_id: str) -> None:
        """Drop a request (its client went away); its pages are freed before the next step."""
        self._inbox.put(("abort", request_id))

    def abort_all(self) -> None:
        self._inbox.put(("abort_all",))

    def _run(self) -> None:
        try:
            while self._take_commands(block=not self.engine.has_unfinished()):
                self._expire(time.monotonic())
                if self.engine.has_unfinished():
                    for output in self.engine.step():
                        self._deliver(output)
                self._publish()
        except BaseException as error:  # the engine is broken: fail every request and let the server exit
            log.exception("engine_failed", error=repr(error))
            self.failure = error
            for tracked in self._tracked.values():
                tracked.stream.put(RequestFailed(500, f"the engine failed: {error!r}"))
            self._tracked.clear()
            self.on_failure(error)

    def _take_commands(self, block: bool) -> bool:
        """Apply queued commands, waiting for one when idle; False on stop."""
        while True:
            try:
                command = self._inbox.get(block=block)
            except queue.Empty:
                return True
            block = False
            match command:
                case ("stop",):
                    return False
                case ("add", request_id, prompt_ids, params, tracked):
                    self._add(request_id, prompt_ids, params, tracked)
                case ("abort", request_id):
                    self._abort(request_id, None)
                case ("abort_all",):
                    for request_id in list(self._tracked):
                        self._abort(request_id, RequestFailed(503, "the server is shutting down"))
            self._publish()

    def _add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, tracked: _Tracked) -> None:
        try:
            self.engine.add_request(prompt_ids, params, request_id)
        except Exception as error:  # the server checks first, so this is a bug: answer the request, keep serving
            log.exception("request_error", request_id=request_id, error=repr(error))
            status = 400 if isinstance(error, ValueError) else 500
            tracked.stream.put(RequestFailed(status, f"the engine could not take the request: {error}"))
            self._finished()
            return
        tracked.prompt_tokens = len(prompt_ids)
        self._tracked[request_id] = tracked

    def _expire(self, now: float) -> None:
        """A request past its deadline ends with what it has (finish_reason "timeout")."""
        for request_id, tracked in list(self._tracked.items()):
            if tracked.deadline is not None and now >= tracked.deadline:
                log.warning("request_timeout", request_id=request_id, request_timeout_s=self.request_timeout_s)
                del self._tracked[request_id]
                tracked.stream.put(self.engine.abort(request_id, "timeout"))
                self._finished()

    def _abort(self, request_id: str, failure: RequestFailed | None) -> None:
        """Take a request out of the engine now; tell its stream `failure`, or nobody when its client is gone."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return
        self.engine.abort(request_id)
        if failure is None:
            log.info("request_aborted", request_id=request_id, output_tokens=tracked.output_tokens)
        else:
            tracked.stream.put(failure)
        self._finished()

    def _deliver(self, output: RequestOutput) -> None:
        tracked = self._tracked.get(output.request_id)
        if tracked is None:
            return
        if output.error is not None:  # this request alone failed (the engine logged why): it gets a 500
            del self._tracked[output.request_id]
            message = f"the request failed inside the engine ({output.error}); the engine serves on"
            tracked.stream.put(RequestFailed(500, message))
            self._finished()
            return
        now = time.monotonic()
        if tracked.first_token is None:
            tracked.first_token = now
            self._counts["prompt_tokens"] += tracked.prompt_tokens
            self.metrics.time_to_first_token.observe(now - tracked.arrival)
        tracked.output_tokens += len(output.new_token_ids)
        self._counts["generation_tokens"] += len(output.new_token_ids)
        tracked.stream.put(output)
        if output.finished:
            del self._tracked[output.request_id]
            if tracked.output_tokens > 1:
                self.metrics.time_per_output_token.observe((now - tracked.first_token) / (tracked.output_tokens - 1))
            log.info(
                "request_finished",
                request_id=output.request_id,
                finish_reason=output.finish_reason,
                prompt_tokens=tracked.prompt_tokens,
                output_tokens=tracked.output_tokens,
                ttft_s=round(tracked.first_token - tracked.arrival, 4),
                seconds=round(now - tracked.arrival, 4),
            )
            self._finished()

    def _finished(self) -> None:
        with self._lock:
            self._unfinished -= 1

    def _publish(self) -> None:
        self.stats = EngineStats(
            **dataclasses.asdict(self.engine.load()),
            prompt_tokens=self._counts["prompt_tokens"],
            generation_tokens=self._counts["generation_tokens"],
            expert_counts=self.engine.expert_counts,
        )
