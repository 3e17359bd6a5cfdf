"""`POST /v1/responses`, the stateless subset (qualification.md §3.4): a Responses request is translated to a chat
request and generated as one; its output is returned as a `response` object or as `response.*` stream events.

In: `input` as a string or items (`message` with text parts, `function_call`, `function_call_output`, and
`reasoning` items, whose text goes back on the next assistant turn as its reasoning), `instructions` (a system
message), flat function tools, `tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`,
`top_p`, `reasoning.effort` (thinking is off without it) and `text.format` (`json_object`, `json_schema`). The
server keeps no responses: `previous_response_id`, `conversation` and `item_reference` items are refused with a
400 that says so, never silently dropped. Other fields (`store`, `include`, `metadata`, …) are ignored.

Out: `output` holds a `reasoning` item (the reasoning as its summary text, and as `reasoning_text` content), a
`message` item with one `output_text` part, and a `function_call` item per call. A stream sends
`response.created` and `response.in_progress`; per item `response.output_item.added`, its part's `.added`, text
deltas (`response.reasoning_summary_text.delta`, `response.output_text.delta`) or
`response.function_call_arguments.delta`, then the `.done` events; and ends with `response.completed`,
`response.incomplete` (the token limit: status `incomplete`, reason `max_output_tokens`) or `response.failed`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from typing import Any

from engine.llm_engine import RequestOutput
from engine.server import dsml
from engine.server.completions import ChatFormatter
from engine.server.grammar import Grammars
from engine.server.protocol import ApiError, GenerationRequest, Limits, invalid, parse_chat
from engine.tokenizer import Tokenizer

# Fields a Responses request shares with a chat request, with the same meaning.
_SHARED_FIELDS = (
    "model",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stream",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "chat_template_kwargs",
)
_TEXT_PARTS = {"input_text", "output_text", "text"}
_CHAT_TOOL_FIELD = re.compile(r"^(tools\[\d+\])\.function\.")


def parse_responses(
    body: Mapping[str, Any], tokenizer: Tokenizer, limits: Limits, grammars: Grammars | None
) -> GenerationRequest:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object", None, "invalid_request_body")
    for field in ("previous_response_id", "conversation"):
        if body.get(field) is not None:
            raise invalid(
                f"{field} is not supported: this server keeps no responses, so send the whole conversation as input",
                field,
                "unsupported_parameter",
            )
    try:
        request = parse_chat(_chat_body(body), tokenizer, limits, grammars)
    except ApiError as error:  # named as this request has it: its input, its flat function tools
        if error.param and error.param.startswith("messages"):
            error.param = "input"
        elif error.param:
            error.param = _CHAT_TOOL_FIELD.sub(r"\1.", error.param)
        raise
    request.echo = _echo(body)
    return request


def _chat_body(body: Mapping[str, Any]) -> dict[str, Any]:
    chat = {field: body[field] for field in _SHARED_FIELDS if field in body}
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise invalid("instructions must be a string", "instructions")
    chat["messages"] = ([{"role": "system", "content": instructions}] if instructions else []) + _messages(
        body.get("input")
    )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise invalid("tools must be an array of tools", "tools")
        chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        chat["reasoning_effort"] = reasoning["effort"]
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, Mapping) else None
    if isinstance(fmt, Mapping) and fmt.get("type") == "json_schema":
        chat["response_format"] = {
            "type": "json_schema",
            "json_schema": {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt},
        }
    elif isinstance(fmt, Mapping):
        chat["response_format"] = dict(fmt)
    return chat


def _messages(given: Any) -> list[dict[str, Any]]:
    """Input items as chat messages: function calls join the assistant turn before them, results become tool
    messages, and a reasoning item's text becomes the next assistant turn's reasoning."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise invalid("input must be a string or a non-empty array of items", "input", "missing_required_parameter")
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, Mapping):
            raise invalid(f"{where} must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            message = {"role": item.get("role"), "content": _content(item.get("content"), f"{where}.content")}
            if message["role"] == "assistant" and reasoning is not None:
                message["reasoning_content"], reasoning = reasoning, None
            messages.append(message)
        elif kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments", "")},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                turn = {"role": "assistant", "content": None, "tool_calls": [call]}
                if reasoning is not None:
                    turn["reasoning_content"], reasoning = reasoning, None
                messages.append(turn)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append(
                {"role": "tool", "tool_call_id": item.get("call_id"), "content": _content(output, f"{where}.output")}
            )
        elif kind == "reasoning":
            reasoning = _reasoning_text(item)
        elif kind == "item_reference":
            raise invalid(f"{where}: item_reference is not supported: this server keeps no items", where)
        else:
            raise invalid(f"{where}: unsupported item type {kind!r}", where)
    return messages


def _content(content: Any, where: str) -> Any:
    """Responses content parts as chat parts: text kinds become `text`; others stay as they are, for the encoder to
    refuse (or, in a tool result, to mark unsupported)."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise invalid(f"{where}[{j}] must be a content part object", where)
        if part.get("type") in _TEXT_PARTS:
            parts.append({"type": "text", "text": part.get("text")})
        elif part.get("type") == "refusal":
            parts.append({"type": "text", "text": part.get("refusal")})
        else:
            parts.append(dict(part))
    return parts


def _reasoning_text(item: Mapping[str, Any]) -> str:
    """A replayed reasoning item's text: its `reasoning_text` content, else its summary."""
    for field, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = [part for part in item.get(field) or [] if isinstance(part, Mapping) and part.get("type") == kind]
        if parts:
            return "\n\n".join(part.get("text") or "" for part in parts)
    return ""


def _tool(tool: Any, where: str) -> Any:
    """A flat Responses function tool in the chat shape; other tool types are refused."""
    if not isinstance(tool, Mapping) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, Mapping) else None
        raise invalid(f"{where}: only function tools are supported, got {kind!r}", "tools")
    if "function" in tool:
        return tool
    function = {key: tool[key] for key in ("name", "description", "parameters", "strict") if key in tool}
    return {"type": "function", "function": function}


def _echo(body: Mapping[str, Any]) -> dict[str, Any]:
    reasoning = body.get("reasoning") if isinstance(body.get("reasoning"), Mapping) else {}
    text = body.get("text") if isinstance(body.get("text"), Mapping) else {}
    return {
        "instructions": body.get("instructions"),
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "text": {"format": text.get("format") or {"type": "text"}},
        "metadata": body.get("metadata") or {},
        "store": False,
        "truncation": "disabled",
    }


class ResponsesFormatter(ChatFormatter):
    """A `response` object, or its stream of `response.*` events (see the module docstring)."""

    def __init__(self, request_id: str, model: str, request: GenerationRequest, tokenizer: Tokenizer):
        super().__init__(request_id, model, request, tokenizer)
        self.items: list[dict[str, Any]] = []  # finished output items
        self.open: dict[str, Any] | None = None  # the reasoning or message item being streamed
        self.text = ""  # the open item's text so far
        self.sequence = 0

    def opening(self) -> list[dict[str, Any]]:
        in_progress = self._response("in_progress", None)
        return [
            self._event("response.created", response=in_progress),
            self._event("response.in_progress", response=in_progress),
        ]

    def events(self, output: RequestOutput) -> list[dict[str, Any]]:
        return self.chunks(output)  # usage is part of the final response event

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        events = []
        for event in self.parsed_events(output):
            if isinstance(event, dsml.ReasoningDelta | dsml.ContentDelta):
                events += self._text_delta("reasoning" if isinstance(event, dsml.ReasoningDelta) else "message", event)
            elif isinstance(event, dsml.ToolCall):
                events += self._close() + self._function_call(event)
        if output.finished:
            status = _status(output)
            events += self._close(status)
            if not any(item["type"] in ("message", "function_call") for item in self.items):
                events += self._open("message") + self._close(status)
            name = "response.completed" if status == "completed" else "response.incomplete"
            events.append(self._event(name, response=self._response(status, output)))
        return events

    def response(self, output: RequestOutput) -> dict[str, Any]:
        parsed = self.parsed(output)
        status = _status(output)
        if parsed.reasoning:
            self.items.append(_reasoning_item(_item_id("rs"), parsed.reasoning))
        if parsed.content or not parsed.tool_calls:
            self.items.append(_message_item(_item_id("msg"), parsed.content, status))
        self.items += [_call_item(_item_id("fc"), call, "completed") for call in parsed.tool_calls]
        return self._response(status, output)

    def failed(self, status: int, message: str) -> list[dict[str, Any]]:
        response = self._response("failed", None) | {"error": {"code": "server_error", "message": message}}
        return [self._event("response.failed", response=response)]

    def sse(self, payload: dict[str, Any]) -> str:
        return f"event: {payload['type']}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def closing(self) -> str:
        return ""  # the Responses stream ends with its final event, without [DONE]

    def _text_delta(self, kind: str, event: dsml.ReasoningDelta | dsml.ContentDelta) -> list[dict[str, Any]]:
        events = [] if self.open is not None and self.open["type"] == kind else self._close() + self._open(kind)
        self.text += event.text
        where = {"item_id": self.open["id"], "output_index": len(self.items)}
        if kind == "reasoning":
            return events + [
                self._event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=event.text)
            ]
        return events + [
            self._event("response.output_text.delta", **where, content_index=0, delta=event.text, logprobs=[])
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        item_id = _item_id("rs" if kind == "reasoning" else "msg")
        where = {"item_id": item_id, "output_index": len(self.items)}
        self.text = ""
        if kind == "reasoning":
            self.open = {"id": item_id, "type": "reasoning", "summary": []}
        else:
            self.open = {"id": item_id, "type": "message", "role": "assistant", "status": "in_progress", "content": []}
        events = [self._event("response.output_item.added", output_index=len(self.items), item=self.open)]
        if kind == "reasoning":
            part = {"type": "summary_text", "text": ""}
            events.append(self._event("response.reasoning_summary_part.added", **where, summary_index=0, part=part))
        else:
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._event("response.content_part.added", **where, content_index=0, part=part))
        return events

    def _close(self, status: str = "completed") -> list[dict[str, Any]]:
        """Finish the open item, if any: its text's and part's `.done` events, then the item's."""
        if self.open is None:
            return []
        item_id, text, where = self.open["id"], self.text, {"item_id": self.open["id"], "output_index": len(self.items)}
        if self.open["type"] == "reasoning":
            item = _reasoning_item(item_id, text)
            done = [
                self._event("response.reasoning_summary_text.done", **where, summary_index=0, text=text),
                self._event("response.reasoning_summary_part.done", **where, summary_index=0, part=item["summary"][0]),
            ]
        else:
            item = _message_item(item_id, text, status)
            done = [
                self._event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, content_index=0, part=item["content"][0]),
            ]
        self.open = None
        done.append(self._event("response.output_item.done", output_index=len(self.items), item=item))
        self.items.append(item)
        return done

    def _function_call(self, call: dsml.ToolCall) -> list[dict[str, Any]]:
        item_id = _item_id("fc")
        where = {"item_id": item_id, "output_index": len(self.items)}
        item = _call_item(item_id, call, "completed")
        events = [
            self._event(
                "response.output_item.added",
                output_index=len(self.items),
                item=_call_item(item_id, call, "in_progress") | {"arguments": ""},
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=len(self.items), item=item),
        ]
        self.items.append(item)
        return events

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    def _response(self, status: str, output: RequestOutput | None) -> dict[str, Any]:
        usage = None
        if output is not None:
            chat = self.usage(output)
            usage = {
                "input_tokens": chat["prompt_tokens"],
                "input_tokens_details": chat["prompt_tokens_details"],
                "output_tokens": chat["completion_tokens"],
                "output_tokens_details": chat["completion_tokens_details"],
                "total_tokens": chat["total_tokens"],
            }
        return {
            "id": self.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": list(self.items),
            "usage": usage,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            **(self.request.echo or {}),
        }


def _status(output: RequestOutput) -> str:
    return "incomplete" if output.finish_reason in ("length", "timeout") else "completed"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [{"type": "summary_text", "text": text}],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": "completed",
    }


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _call_item(item_id: str, call: dsml.ToolCall, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }
