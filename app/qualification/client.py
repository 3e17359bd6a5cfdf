"""The gates' client for any OpenAI-compatible endpoint (httpx; the console does not depend on the `openai`
package). Every call returns an Exchange: what was asked, what came back and when, which is what evidence keeps.
A call never raises for an HTTP or transport failure: a failed answer is evidence, and the ladder decides whether
the engine is gone."""

from __future__ import annotations

import hashlib
import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import httpx

# Strings longer than this (haystacks, fillers, long answers) are kept as their head and tail, with the length and
# sha256 of the whole, so evidence stays small and still identifies exactly what was sent.
MAX_TEXT = 600
KEEP = 240
# Stream events kept verbatim: the first few and the last few.
KEEP_EVENTS = 3


def shorten(value: Any) -> Any:
    if isinstance(value, str) and len(value) > MAX_TEXT:
        digest = hashlib.sha256(value.encode()).hexdigest()[:16]
        return f"{value[:KEEP]} … [{len(value):,} chars, sha256 {digest}] … {value[-KEEP:]}"
    if isinstance(value, dict):
        return {k: shorten(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shorten(v) for v in value]
    return value


@dataclass
class Exchange:
    """One request and its answer, read the way an agent client reads it."""

    observation: str
    method: str
    path: str
    request: dict[str, Any] | None
    # None when no HTTP answer came (connection refused or reset, timeout): `error` says what happened.
    status: int | None = None
    error: str | None = None
    body: Any = None
    seconds: float = 0.0
    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    stream: bool = False
    events: int = 0
    done: bool = False
    # Client clock from the start: first non-empty reasoning or content delta, first non-empty content delta.
    ttfo_s: float | None = None
    ttft_s: float | None = None
    # What the gate concluded about this observation, in its words.
    check: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None

    def outcome(self) -> str:
        """The answer in a few words, for a gate's summary."""
        if self.status is None:
            return f"no answer ({self.error})"
        if self.status != 200:
            message = self.body.get("error", {}).get("message") if isinstance(self.body, dict) else None
            message = message if isinstance(message, str) else str(self.body)[:160]
            return f"HTTP {self.status}: {message}"
        if self.error:
            return f"HTTP 200 with an error: {self.error}"
        return f"HTTP 200, finish_reason {self.finish_reason}"

    def evidence(self) -> dict[str, Any]:
        return {
            "observation": self.observation,
            "request": {"method": self.method, "path": self.path, "body": shorten(self.request)},
            "response": {
                "status": self.status,
                "error": self.error,
                "body": shorten(self.body),
                "content": shorten(self.content),
                "reasoning_chars": len(self.reasoning),
                "reasoning": shorten(self.reasoning),
                "tool_calls": shorten(self.tool_calls),
                "finish_reason": self.finish_reason,
            },
            "usage": self.usage,
            "timings": {
                "seconds": round(self.seconds, 4),
                "ttfo_s": None if self.ttfo_s is None else round(self.ttfo_s, 4),
                "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            },
            "stream": {"events": self.events, "done": self.done} if self.stream else None,
            "check": self.check,
        }


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text[:4000]


def _read_message(exchange: Exchange, body: Any) -> None:
    if not isinstance(body, dict):
        exchange.error = "the answer is not a JSON object"
        return
    exchange.usage = body.get("usage")
    choices = body.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        exchange.error = "the answer has no choices"
        return
    message = choices[0].get("message") or {}
    exchange.content = message.get("content") or ""
    exchange.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    exchange.tool_calls = message.get("tool_calls") or []
    exchange.finish_reason = choices[0].get("finish_reason")


class EngineClient:
    def __init__(self, base_url: str, model: str, timeout_s: float) -> None:
        self.base_url = base_url
        self.model = model
        self.http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(timeout_s, connect=5.0))

    def close(self) -> None:
        self.http.close()

    def get(self, observation: str, path: str) -> Exchange:
        exchange = Exchange(observation, "GET", path, None)
        start = time.perf_counter()
        try:
            response = self.http.get(path)
            exchange.status, exchange.body = response.status_code, _json(response)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        exchange.seconds = time.perf_counter() - start
        return exchange

    def chat(self, observation: str, body: dict[str, Any]) -> Exchange:
        exchange = Exchange(observation, "POST", "/v1/chat/completions", {"model": self.model, **body})
        start = time.perf_counter()
        try:
            response = self.http.post(exchange.path, json=exchange.request)
            exchange.status, exchange.body = response.status_code, _json(response)
            if response.status_code == 200:
                _read_message(exchange, exchange.body)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        exchange.seconds = time.perf_counter() - start
        return exchange

    def stream_chat(self, observation: str, body: dict[str, Any]) -> Exchange:
        """A streamed chat completion, read as Pi reads it: deltas, tool-call fragments grouped by index, the usage
        chunk, `[DONE]`."""
        request = {"model": self.model, **body, "stream": True, "stream_options": {"include_usage": True}}
        exchange = Exchange(observation, "POST", "/v1/chat/completions", request, stream=True)
        start = time.perf_counter()
        head: list[Any] = []
        tail: deque[Any] = deque(maxlen=KEEP_EVENTS)
        calls: dict[int, dict[str, Any]] = {}
        try:
            with self.http.stream("POST", exchange.path, json=request) as response:
                exchange.status = response.status_code
                if response.status_code != 200:
                    response.read()
                    exchange.body = _json(response)
                else:
                    for line in response.iter_lines():
                        if not line.startswith("data:"):
                            continue
                        data = line[5:].strip()
                        if data == "[DONE]":
                            exchange.done = True
                            continue
                        exchange.events += 1
                        try:
                            chunk = json.loads(data)
                        except ValueError:
                            exchange.error = f"event {exchange.events} is not JSON: {data[:200]}"
                            continue
                        (head if len(head) < KEEP_EVENTS else tail).append(chunk)
                        self._read_chunk(exchange, chunk, calls, time.perf_counter() - start)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        exchange.seconds = time.perf_counter() - start
        exchange.tool_calls = [calls[i] for i in sorted(calls)]
        if exchange.body is None:
            exchange.body = {"first_events": head, "last_events": list(tail)}
        return exchange

    @staticmethod
    def _read_chunk(exchange: Exchange, chunk: Any, calls: dict[int, dict[str, Any]], now: float) -> None:
        if not isinstance(chunk, dict):
            return
        if "error" in chunk:
            exchange.error = f"error event: {json.dumps(chunk['error'])[:400]}"
        if chunk.get("usage"):
            exchange.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
            content = delta.get("content") or ""
            if (reasoning or content) and exchange.ttfo_s is None:
                exchange.ttfo_s = now
            if content and exchange.ttft_s is None:
                exchange.ttft_s = now
            exchange.reasoning += reasoning
            exchange.content += content
            for fragment in delta.get("tool_calls") or []:
                call = calls.setdefault(
                    fragment.get("index", 0), {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] += fragment.get("id") or ""
                function = fragment.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                exchange.finish_reason = choice["finish_reason"]

    def responses(self, observation: str, body: dict[str, Any]) -> Exchange:
        exchange = Exchange(observation, "POST", "/v1/responses", {"model": self.model, **body})
        start = time.perf_counter()
        try:
            response = self.http.post(exchange.path, json=exchange.request)
            exchange.status, exchange.body = response.status_code, _json(response)
        except httpx.HTTPError as exc:
            exchange.error = f"{type(exc).__name__}: {exc}"
        exchange.seconds = time.perf_counter() - start
        body = exchange.body
        if exchange.status == 200 and isinstance(body, dict):
            exchange.usage = body.get("usage")
            for item in body.get("output") or []:
                for part in item.get("content") or [] if isinstance(item, dict) else []:
                    if isinstance(part, dict) and part.get("type") == "output_text":
                        exchange.content += part.get("text") or ""
                if isinstance(item, dict) and item.get("type") == "reasoning":
                    exchange.reasoning += json.dumps(item.get("summary") or item.get("content") or "")
            exchange.finish_reason = body.get("status")
        return exchange
