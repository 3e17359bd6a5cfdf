"""OpenAI-compatible requests in: body checks, prompt tokens, sampling parameters, the output grammar and the
context limits, with OpenAI-shaped errors that name the field and the limit.

Unknown fields are accepted and ignored (clients send many: `store`, `metadata`, `user`, …). Known fields this
engine cannot honour with a non-default value (`n` > 1, `echo`, `best_of`, `suffix`) are refused rather than
silently ignored. Chat requests as agents send them (docs/agent-api.md):

- A `developer` message is a system message. OpenAI made `developer` the new name of `system`; DeepSeek-V4's own
  `developer` role (dsv4-chat-format.md §3) is an internal one, rendered as a user turn and dropped from history in
  thinking mode, which would lose an agent's instructions after its first turn.
- `tools` and `response_format` are declared to the model on the first system message, as the encoder expects;
  `tool_choice`, `parallel_tool_calls`, `strict` tools and `response_format` become the request's output grammar
  (grammar.py). `max_completion_tokens` wins over `max_tokens`.
- Thinking is off unless `reasoning_effort`, `chat_template_kwargs.thinking` / `.enable_thinking` or a top-level
  `enable_thinking` asks for it.

What one request may cost is bounded before the costly part (docs/agent-api.md, "Limits"): the body's JSON nests at
most `MAX_JSON_DEPTH` levels and holds no NaN/Infinity and no lone UTF-16 surrogate (each refused naming its path);
a prompt whose UTF-8 text is longer than the context could hold (`prompt_bytes_limit`) is refused before it is
tokenized; at most `MAX_STOP_STRINGS` stop strings of at most `MAX_STOP_STRING_CHARS` characters each.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from engine.sequence import output_budget
from engine.server.chat_encoding import ChatEncodingError, declare, encode_messages
from engine.server.grammar import GrammarError, Grammars, output_format
from engine.server.tool_calls import ToolsError, parse_tool_policy
from engine.tokenizer import Tokenizer

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 1024
MAX_JSON_DEPTH = 64
# A UTF-8 byte of text takes at most 6 bytes of JSON (a control byte as \u00XX); the fixed part covers the fields
# around the text (sampling parameters, schemas).
JSON_BYTES_PER_TEXT_BYTE = 6
BODY_BYTES_FIXED = 1 << 20


def _lone_surrogate(text: str) -> bool:
    """Whether text holds a lone UTF-16 surrogate (json.loads pairs the others into one character), which UTF-8
    cannot encode. An ASCII string is known to hold none without a scan: a prompt's 100 KB took 0.9 ms to scan."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


_CHECKED = (str, float, dict, list)  # what parse_body looks into; ints, booleans and nulls are always acceptable JSON


class ApiError(Exception):
    """An HTTP error with an OpenAI-shaped body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_error", 503: "server_error"}

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        kind = self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True)
class Limits:
    """What every request is checked against."""

    served_model_name: str
    context_length: int
    kv_capacity_tokens: int
    vocab_size: int


def prompt_bytes_limit(limits: Limits, tokenizer: Tokenizer) -> int:
    """A prompt's UTF-8 text of more bytes than this has more tokens than the context holds."""
    return limits.context_length * tokenizer.max_token_bytes


def body_bytes_limit(limits: Limits, tokenizer: Tokenizer) -> int:
    """The largest request body that can hold a prompt the context admits."""
    return JSON_BYTES_PER_TEXT_BYTE * prompt_bytes_limit(limits, tokenizer) + BODY_BYTES_FIXED


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object whose every value the engine can take (see the module's docstring)."""
    try:
        body = json.loads(raw)
    except RecursionError as error:
        raise _too_deep("the top") from error
    except ValueError as error:
        raise invalid(f"the request body is not valid JSON: {error}", None, "invalid_json") from error
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object", None, "invalid_request_body")
    pending: list[tuple[Any, str, int]] = [(body, "", 1)]
    while pending:
        value, where, depth = pending.pop()
        if isinstance(value, str):
            if _lone_surrogate(value):
                raise invalid(f"{where} holds a lone UTF-16 surrogate, which is not text", where)
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise invalid(f"{where} must be a finite number, got {value}", where)
        elif isinstance(value, dict | list):
            if depth > MAX_JSON_DEPTH:
                raise _too_deep(where)
            if isinstance(value, list):  # token ids come by the million: only what can hold a bad value is visited
                pending += (
                    (item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value) if isinstance(item, _CHECKED)
                )
                continue
            for key, item in value.items():
                inner = f"{where}.{key}" if where else key
                if _lone_surrogate(key):
                    raise invalid(f"a key in {where or 'the body'} holds a lone UTF-16 surrogate", where or None)
                pending.append((item, inner, depth + 1))
    return body


def _too_deep(where: str) -> ApiError:
    return invalid(f"the request body nests deeper than {MAX_JSON_DEPTH} levels (at {where})", None, "invalid_json")


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool
    warning: str | None  # a `Warning` header value when max_tokens was clamped
    thinking: bool = False  # chat: the completion starts with reasoning
    tools_offered: bool = False  # chat: DSML tool calls are parsed out of the completion
    calls_allowed: bool = True  # chat: parsed calls are returned (not under tool_choice "none")
    echo: Mapping[str, Any] | None = None  # the request fields a Responses object repeats


def parse_chat(
    body: Mapping[str, Any], tokenizer: Tokenizer, limits: Limits, grammars: Grammars | None
) -> GenerationRequest:
    _check_model(body, limits)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty array of messages", "messages", "missing_required_parameter")
    try:
        policy = parse_tool_policy(body)
    except ToolsError as error:
        raise invalid(str(error), error.param) from error
    response_format, response_schema = _response_format(body)
    thinking, effort = _thinking(body)
    messages = declare(
        [_developer_as_system(message) for message in messages], body.get("tools") or [], response_format
    )
    try:
        text = encode_messages(messages, "thinking" if thinking else "chat", reasoning_effort=effort)
    except ChatEncodingError as error:
        raise invalid(str(error), error.where) from error
    logprobs = _optional(body, "logprobs", bool)
    top = _optional(body, "top_logprobs", int)
    if top is not None and not logprobs:
        raise invalid("top_logprobs needs logprobs: true", "top_logprobs")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be between 0 and {MAX_LOGPROBS}, got {top}", "top_logprobs")
    _check_prompt_bytes(text, "messages", tokenizer, limits)
    prompt_ids = tokenizer.encode(text)  # the encoder wrote BOS as text; it encodes to its one id
    max_tokens_field = next(
        (f for f in ("max_completion_tokens", "max_output_tokens") if body.get(f) is not None), "max_tokens"
    )
    request = _generation(body, prompt_ids, "messages", max_tokens_field, (top or 0) if logprobs else None, limits)
    request.thinking, request.tools_offered = thinking, bool(policy.tools)
    request.calls_allowed = policy.choice != "none"
    fmt = output_format(policy, response_schema)
    param = "response_format" if response_schema is not None else "tools"
    if grammars is None:
        # Only a required call or JSON content cannot do without a grammar: `strict` is then ignored, and
        # tool_choice "none" relies on the parser dropping calls.
        if response_schema is not None or policy.choice in ("required", "named"):
            raise invalid("this model's tokenizer is not byte-level, so its output cannot be constrained", param)
    elif fmt is not None:
        try:
            request.params.constraint = grammars.constraint(fmt, thinking)
        except (GrammarError, ToolsError) as error:
            raise invalid(str(error), getattr(error, "param", param)) from error
    return request


def parse_completion(body: Mapping[str, Any], tokenizer: Tokenizer, limits: Limits) -> GenerationRequest:
    _check_model(body, limits)
    for name, default in (("echo", False), ("suffix", None)):
        if body.get(name, default) not in (default, None):
            raise invalid(f"{name} is not supported", name, "unsupported_parameter")
    if (best_of := _optional(body, "best_of", int)) not in (None, 1):
        raise invalid(f"best_of must be 1, got {best_of}", "best_of", "unsupported_parameter")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        _check_prompt_bytes(prompt, "prompt", tokenizer, limits)
        prompt_ids = tokenizer.encode(prompt, add_bos=True)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < limits.vocab_size), None)
        if bad is not None:
            raise invalid(
                f"prompt[{bad}] = {prompt[bad]} is not a token id (vocabulary of {limits.vocab_size})", "prompt"
            )
        prompt_ids = list(prompt)
    else:
        raise invalid(
            "prompt must be a non-empty string or array of token ids (one prompt per request)",
            "prompt",
            "missing_required_parameter" if prompt is None else "invalid_value",
        )
    logprobs = _optional(body, "logprobs", int)
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise invalid(f"logprobs must be between 0 and {MAX_LOGPROBS}, got {logprobs}", "logprobs")
    return _generation(body, prompt_ids, "prompt", "max_tokens", logprobs, limits)


def _generation(
    body: Mapping[str, Any],
    prompt_ids: list[int],
    prompt_field: str,
    max_tokens_field: str,
    logprobs: int | None,
    limits: Limits,
) -> GenerationRequest:
    if (n := _optional(body, "n", int)) not in (None, 1):
        raise invalid(f"n must be 1, got {n}: one choice per request", "n", "unsupported_parameter")
    stream = bool(_optional(body, "stream", bool))
    options = _optional(body, "stream_options", dict) or {}
    include_usage = bool(_optional(options, "include_usage", bool, "stream_options.include_usage"))
    max_tokens, warning = fit_max_tokens(
        len(prompt_ids), _optional(body, max_tokens_field, int), prompt_field, max_tokens_field, limits
    )
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise invalid("stop must be a non-empty string or an array of them", "stop")
    if stop and len(stop) > MAX_STOP_STRINGS:
        raise invalid(f"stop has {len(stop)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if stop and (longest := max(len(s) for s in stop)) > MAX_STOP_STRING_CHARS:
        raise invalid(f"a stop string has {longest} characters; at most {MAX_STOP_STRING_CHARS} are allowed", "stop")
    top_k = _optional(body, "top_k", int)
    try:
        params = SamplingParams(
            temperature=_real(body, "temperature", 1.0),
            top_p=_real(body, "top_p", 1.0),
            top_k=0 if top_k in (None, -1) else top_k,  # -1 is vLLM's "off"
            max_tokens=max_tokens,
            stop=stop or [],
            stop_token_ids=_token_ids(body, "stop_token_ids", limits),
            ignore_eos=bool(_optional(body, "ignore_eos", bool)),
            seed=_optional(body, "seed", int),
            logprobs=logprobs,
        )
    except ValueError as error:  # its messages start with the field's name
        raise invalid(str(error), str(error).split()[0]) from error
    return GenerationRequest(prompt_ids, params, stream, include_usage, warning)


def fit_max_tokens(
    prompt_len: int, requested: int | None, prompt_field: str, max_tokens_field: str, limits: Limits
) -> tuple[int, str | None]:
    """The output budget (`output_budget`, the engine's rule): the room the context (and the KV pool) leaves after
    the prompt. A prompt that alone fills it is refused; a larger request is clamped, and the returned warning says
    so."""
    context = limits.context_length
    if prompt_len >= context:
        raise invalid(
            f"the prompt has {prompt_len} tokens, which reaches context_length {context}: "
            f"at most {context - 1} prompt tokens leave room for an answer",
            prompt_field,
            "context_length_exceeded",
        )
    capacity = limits.kv_capacity_tokens
    if prompt_len >= capacity:
        raise invalid(
            f"the prompt has {prompt_len} tokens; the KV pool holds {capacity} tokens (kv_capacity_tokens)",
            prompt_field,
            "context_length_exceeded",
        )
    if requested is not None and requested < 1:
        raise invalid(f"{max_tokens_field} must be >= 1, got {requested}", max_tokens_field)
    max_request_tokens = min(context, capacity)
    room = output_budget(prompt_len, max_request_tokens, max_request_tokens)
    if requested is None or requested <= room:
        return requested or room, None
    limit = f"context_length is {context}" if context <= capacity else f"the KV pool holds {capacity} tokens"
    return (
        room,
        f'299 - "{max_tokens_field} {requested} clamped to {room}: the prompt has {prompt_len} tokens and {limit}"',
    )


def _check_prompt_bytes(text: str, field: str, tokenizer: Tokenizer, limits: Limits) -> None:
    """Refuse, before tokenizing it, a prompt too long for the context whatever its tokens."""
    limit = prompt_bytes_limit(limits, tokenizer)
    if (size := len(text.encode(errors="surrogatepass"))) > limit:
        raise invalid(
            f"the prompt is {size} bytes of UTF-8: more than context_length {limits.context_length} tokens can hold "
            f"(a token is at most {tokenizer.max_token_bytes} bytes here, so at most {limit} bytes)",
            field,
            "context_length_exceeded",
        )


def _check_model(body: Any, limits: Limits) -> None:
    if not isinstance(body, Mapping):
        raise invalid("the request body must be a JSON object", None, "invalid_request_body")
    model = body.get("model")
    if model is not None and model != limits.served_model_name:
        message = f"model {model!r} is not served here; this server serves {limits.served_model_name!r}"
        raise ApiError(404, message, "model", "model_not_found")


def _thinking(body: Mapping[str, Any]) -> tuple[bool, str | None]:
    """Thinking is off unless `reasoning_effort`, `chat_template_kwargs.thinking` / `.enable_thinking` or a top-level
    `enable_thinking` asks for it. Flags that contradict each other or `reasoning_effort` are refused, since
    silently picking one is how thinking controls become no-ops."""
    kwargs = _optional(body, "chat_template_kwargs", dict) or {}
    flags = {f"chat_template_kwargs.{n}": _optional(kwargs, n, bool, f"chat_template_kwargs.{n}") for n in _FLAGS}
    flags["enable_thinking"] = _optional(body, "enable_thinking", bool)
    given = {where: value for where, value in flags.items() if value is not None}
    if len(set(given.values())) > 1:
        raise invalid(f"thinking flags disagree: {given}", next(iter(given)))
    effort = _optional(body, "reasoning_effort", str)
    if effort == "none":
        return bool(given) and next(iter(given.values())), None
    if not given:
        return effort is not None, effort
    where, on = next(iter(given.items()))
    if not on and effort is not None:
        raise invalid(f"reasoning_effort {effort!r} asks for thinking but {where} is false", "reasoning_effort")
    return on, effort


_FLAGS = ("thinking", "enable_thinking")


def _response_format(body: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, Mapping[str, Any] | bool | None]:
    """`response_format` as declared to the model (None for text) and the JSON Schema the content must match:
    `json_object` is any object; `json_schema` its `schema` (enforced whether or not `strict` is set)."""
    given = _optional(body, "response_format", dict)
    kind = (given or {}).get("type", "text")
    if kind == "text":
        return None, None
    if kind == "json_object":
        return given, {"type": "object"}
    if kind == "json_schema":
        spec = _optional(given, "json_schema", dict, "response_format.json_schema") or {}
        schema = spec.get("schema", True)
        if not isinstance(schema, dict | bool):
            raise invalid("response_format.json_schema.schema must be a JSON Schema", "response_format")
        return given, schema
    raise invalid(
        f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "response_format"
    )


def _developer_as_system(message: Any) -> Any:
    if isinstance(message, Mapping) and message.get("role") == "developer":
        return {**message, "role": "system"}
    return message


def _token_ids(body: Mapping[str, Any], name: str, limits: Limits) -> list[int]:
    ids = body.get(name) or []
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t < limits.vocab_size for t in ids
    ):
        raise invalid(f"{name} must be an array of token ids below {limits.vocab_size}", name)
    return ids


def _real(body: Mapping[str, Any], name: str, default: float) -> float:
    """A number field as a float; an integer too large for one is refused rather than overflowing."""
    value = _optional(body, name, float, default=default)
    try:
        return float(value)
    except OverflowError as error:
        raise invalid(f"{name} must be a finite number, got an integer of {value.bit_length()} bits", name) from error


_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", dict: "an object"}


def _optional(body: Mapping[str, Any], name: str, kind: type, where: str | None = None, default: Any = None) -> Any:
    """`body[name]` if present and not null, checked to be of `kind` (an int is a number; a bool is neither)."""
    value = body.get(name)
    if value is None:
        return default
    if kind in (int, float):
        ok = isinstance(value, int if kind is int else int | float) and not isinstance(value, bool)
    else:
        ok = isinstance(value, kind)
    if not ok:
        where = where or name
        raise invalid(f"{where} must be {_TYPE_NAMES[kind]}, got {value!r}", where, "invalid_type")
    return value
