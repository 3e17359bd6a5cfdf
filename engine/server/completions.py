"""OpenAI-compatible responses out: `chat.completion` and `text_completion` objects, and their stream chunks.

Chat output goes through the DSML parser: reasoning to `reasoning_content`, tool-call blocks to `tool_calls` (when
tools were offered; dropped and logged under `tool_choice` "none"), the rest to `content`. A stream and a whole
response of the same output carry the same text, since the parser's events do not depend on how the text was
split. A stream is `opening()`, then `events()` of each output, then `closing()`; `failed()` replaces what is left
when the engine gives up on the request.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from engine.llm_engine import RequestOutput
from engine.sequence import TokenLogprob
from engine.server import dsml
from engine.server.chat_encoding import THINK_END
from engine.server.protocol import ApiError, GenerationRequest
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)


def client_finish_reason(output: RequestOutput, tool_calls: bool) -> str:
    """The engine's finish reason as clients know it. Calls win: they are emitted only once closed, so the model had
    finished them. Otherwise `length` when the token limit (or the request's timeout) cut the completion, else
    `stop`."""
    if tool_calls:
        return "tool_calls"
    return "length" if output.finish_reason in ("length", "timeout") else "stop"


class _Formatter:
    object_name = ""

    def __init__(self, request_id: str, model: str, request: GenerationRequest, tokenizer: Tokenizer):
        self.request_id, self.model, self.request, self.tokenizer = request_id, model, request, tokenizer
        self.created = int(time.time())

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": self.object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def opening(self) -> list[dict[str, Any]]:
        return []

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        """What one output adds to the stream: its chunks, and the usage chunk after the last when asked."""
        usage = [self._envelope([], usage=self.usage(output))] if output.finished and self.request.include_usage else []
        return self.chunks(output) + usage

    def failed(self, status: int, message: str) -> list[dict[str, Any]]:
        return [ApiError(status, message, code="request_failed").body()]

    def sse(self, payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def closing(self) -> str:
        return "data: [DONE]\n\n"

    def usage(self, output: RequestOutput) -> dict[str, Any]:
        prompt, completion = len(output.prompt_token_ids), len(output.token_ids)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": output.cached_tokens},
            "completion_tokens_details": {"reasoning_tokens": self._reasoning_tokens(output.token_ids)},
        }

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        return 0

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


class ChatFormatter(_Formatter):
    object_name = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, request: GenerationRequest, tokenizer: Tokenizer):
        super().__init__(request_id, model, request, tokenizer)
        self.parser = dsml.StreamingParser(tools_offered=request.tools_offered, thinking=request.thinking)
        self.tool_calls = False
        self.think_end = tokenizer.token_id(THINK_END)

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        """The deltas this output adds (its logprobs on the first, or on an empty delta)."""
        chunks = [self._chunk(delta) for delta in self._deltas(self.parsed_events(output))]
        if output.new_logprobs and self.request.params.logprobs is not None:
            logprobs = {"content": [self._logprob(lp) for lp in output.new_logprobs]}
            if not chunks:
                chunks.append(self._chunk({}))
            chunks[0]["choices"][0]["logprobs"] = logprobs
        if output.finished:
            chunks.append(self._chunk({}, client_finish_reason(output, self.tool_calls)))
        return chunks

    def parsed_events(self, output: RequestOutput) -> list[dsml.StreamEvent]:
        """The parser's events for this output, calls dropped under tool_choice "none", dropped text logged."""
        events = self.parser.feed(output.new_text)
        if output.finished:
            events += self.parser.finish()
        kept, dropped = [], []
        for event in events:
            dropping = isinstance(event, dsml.Malformed) or (
                isinstance(event, dsml.ToolCall) and not self.request.calls_allowed
            )
            (dropped if dropping else kept).append(event)
        _log_malformed(self.request_id, [_as_dropped(event) for event in dropped])
        return kept

    def parsed(self, output: RequestOutput) -> dsml.ParsedCompletion:
        """The whole output parsed, calls dropped under tool_choice "none", dropped text logged."""
        parsed = dsml.parse_output(output.text, self.request.tools_offered, self.request.thinking)
        dropped = parsed.malformed + ([] if self.request.calls_allowed else parsed.tool_calls)
        _log_malformed(self.request_id, [_as_dropped(event) for event in dropped])
        if not self.request.calls_allowed:
            parsed.tool_calls = []
        return parsed

    def response(self, output: RequestOutput) -> dict[str, Any]:
        parsed = self.parsed(output)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content or (None if parsed.tool_calls else ""),
        }
        if self.request.thinking:
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call(call) for call in parsed.tool_calls]
        logprobs = None
        if self.request.params.logprobs is not None:
            logprobs = {"content": [self._logprob(lp) for lp in output.logprobs or []]}
        choice = {
            "index": 0,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": client_finish_reason(output, bool(parsed.tool_calls)),
        }
        return self._envelope([choice], usage=self.usage(output)) | {"object": "chat.completion"}

    def _deltas(self, events: list[dsml.StreamEvent]) -> list[dict[str, Any]]:
        deltas = []
        for event in events:
            if isinstance(event, dsml.ReasoningDelta):
                deltas.append({"reasoning_content": event.text})
            elif isinstance(event, dsml.ContentDelta):
                deltas.append({"content": event.text})
            elif isinstance(event, dsml.ToolCall):
                self.tool_calls = True
                deltas.append({"tool_calls": [_tool_call(event) | {"index": event.index}]})
        return deltas

    def _chunk(self, delta: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        return self._envelope([{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}])

    def _logprob(self, lp: TokenLogprob) -> dict[str, Any]:
        top = sorted(lp.top.items(), key=lambda item: -item[1])
        return {
            **self._entry(lp.token_id, lp.logprob),
            "top_logprobs": [self._entry(token_id, value) for token_id, value in top],
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _reasoning_tokens(self, token_ids: list[int]) -> int:
        if not self.request.thinking:
            return 0
        return token_ids.index(self.think_end) if self.think_end in token_ids else len(token_ids)


class CompletionFormatter(_Formatter):
    object_name = "text_completion"

    def __init__(self, request_id: str, model: str, request: GenerationRequest, tokenizer: Tokenizer):
        super().__init__(request_id, model, request, tokenizer)
        self.offset = 0  # characters of text the logprobs' tokens cover so far

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        logprobs = self._logprobs(output.new_logprobs) if self.request.params.logprobs is not None else None
        if not output.new_text and logprobs is None and not output.finished:
            return []
        reason = client_finish_reason(output, False) if output.finished else None
        return [self._envelope([{"index": 0, "text": output.new_text, "logprobs": logprobs, "finish_reason": reason}])]

    def response(self, output: RequestOutput) -> dict[str, Any]:
        logprobs = self._logprobs(output.logprobs or []) if self.request.params.logprobs is not None else None
        choice = {
            "index": 0,
            "text": output.text,
            "logprobs": logprobs,
            "finish_reason": client_finish_reason(output, False),
        }
        return self._envelope([choice], usage=self.usage(output))

    def _logprobs(self, entries: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any]:
        tokens = [self._token(lp.token_id) for lp in entries]
        offsets = []
        for token in tokens:
            offsets.append(self.offset)
            self.offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{self._token(t): v for t, v in lp.top.items()} for lp in entries],
            "text_offset": offsets,
        }


def _tool_call(call: dsml.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def _as_dropped(event: dsml.Malformed | dsml.ToolCall) -> dsml.Malformed:
    if isinstance(event, dsml.ToolCall):
        return dsml.Malformed(f"{event.name}({event.arguments})", 'a tool call under tool_choice "none"')
    return event


def _log_malformed(request_id: str, malformed: list[dsml.Malformed]) -> None:
    for event in malformed:
        log.warning("dsml_dropped", request_id=request_id, reason=event.reason, text=event.text[:200])
