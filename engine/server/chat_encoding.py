"""DeepSeek-V4 chat encoding: OpenAI-style messages to prompt text.

Implements shared/reference/dsv4-chat-format.md: the special tokens (§2), the turn structure (§3), thinking on/off
and history dropping (§4), the encoder parameters (§5), the reasoning_effort prefix per checkpoint profile (§6),
tool declarations and DSML tool calls in history (§7), tool results (§8) and quick-instruction tasks (§9).

The output is byte-for-byte what the vendor encoder renders (every encode vector of
shared/data/dsv4_chat_vectors.json), except where §11 documents a bug or quirk:

- §11.1: arguments given as an object render like the equivalent JSON string, one parameter per key.
- §11.2: arguments that are null, empty or JSON ``null`` render as a call without parameters (as vLLM coerces them
  to ``{}``); any other text that is not a JSON object renders verbatim as one string parameter named
  ``arguments`` (as invalid JSON already does, and as DeepSeek's later reference renders non-objects).
- §11.3: ``reasoning_effort="low"`` is never an error; on the preview profile it adds nothing, like ``"high"``.
- §11.4: the format has no escapes, so text that would end its field early on replay (``</tool_result>`` in a
  tool result, ``｜DSML｜`` in a tool call) is rejected rather than rendered.

Two further choices where the vendor encoder crashes or is silent: content given as a list of parts keeps its text
parts joined by a blank line (copy B's rule for user parts; §8's rule for tool results), and when ``context`` is
given exactly the new messages are rendered even if dropping removed a developer message from the context.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

# §2: the exact strings. "｜" is U+FF5C and "▁" is U+2581.
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
LATEST_REMINDER = "<｜latest_reminder｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
TOOL_CALLS_OPEN = f"<{DSML}tool_calls>"
TOOL_CALLS_CLOSE = f"</{DSML}tool_calls>"
INVOKE_OPEN = f"<{DSML}invoke"
INVOKE_CLOSE = f"</{DSML}invoke>"
PARAMETER_OPEN = f"<{DSML}parameter"
PARAMETER_CLOSE = f"</{DSML}parameter>"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"

# §9: quick-instruction tasks and the token each appends.
TASK_TOKENS = {
    "action": "<｜action｜>",
    "query": "<｜query｜>",
    "authority": "<｜authority｜>",
    "domain": "<｜domain｜>",
    "title": "<｜title｜>",
    "read_url": "<｜read_url｜>",
}

ThinkingMode = Literal["thinking", "chat"]
EffortProfile = Literal["0731", "preview"]

# §6, paragraph P1.
_EFFORT_ABSOLUTE_MAXIMUM = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root cause,"
    " rigorously stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered"
    " alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
# §6, paragraph P2 (the dash is U+2014).
_EFFORT_BEYOND_MAXIMUM = (
    "Reasoning Effort: Beyond maximum — exhaustive, relentless, and uncompromising.\n"
    "You MUST reason with the utmost depth and rigor, leaving absolutely nothing to chance: exhaustively decompose"
    " the problem into its most fundamental components, trace every causal chain to its root, and resolve the"
    " underlying cause rather than any surface symptom.\n"
    "Do not stop reasoning until you have independently verified the solution from multiple angles and are certain"
    " that no assumption remains unchecked and no error remains undiscovered.\n\n"
)

# §6: the paragraph each level puts after BOS in thinking mode, per checkpoint profile; an unlisted level adds
# nothing. The table must match the checkpoint's bundled encoder, or every level lands one tier low (§11.3).
REASONING_EFFORT_PREFIXES: dict[str, dict[str, str]] = {
    "0731": {"high": _EFFORT_ABSOLUTE_MAXIMUM, "max": _EFFORT_BEYOND_MAXIMUM},
    "preview": {"max": _EFFORT_ABSOLUTE_MAXIMUM},
}
REASONING_EFFORT_LEVELS = ("low", "high", "max")
# Levels clients send that DeepSeek-V4 lacks, mapped to the nearest one as the hosted API maps medium and xhigh (§6).
REASONING_EFFORT_ALIASES = {"minimal": "low", "medium": "high", "xhigh": "max"}

# §7: the fixed part of the Tools section (953 characters around the schema lines).
_TOOLS_SECTION = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside <think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""  # noqa: E501 - the section is model input and must stay byte-exact
_RESPONSE_FORMAT_SECTION = "## Response Format:\n\nYou MUST strictly adhere to the following schema to reply:\n{schema}"

_ROLES = ("system", "developer", "user", "assistant", "tool", "latest_reminder")
# Prior reasoning comes back under the field name it streamed in (qualification.md §3.2); first present wins.
_REASONING_FIELDS = ("reasoning_content", "reasoning", "reasoning_text")


class ChatEncodingError(ValueError):
    """A request the encoder cannot render; the message says where (``messages[2].tool_calls[0]…``) and why."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


@dataclass
class _Part:
    """A piece of a user turn: typed text, or a rendered tool result (tool_call_id set, "" when absent)."""

    text: str
    tool_call_id: str | None = None


@dataclass
class _ToolCall:
    id: str
    invoke: str  # the rendered <｜DSML｜invoke> element


@dataclass
class _Turn:
    """One rendered turn; tool messages are already folded into user turns (§8)."""

    role: str
    text: str = ""
    parts: list[_Part] = field(default_factory=list)
    reasoning: str = ""
    tool_calls: list[_ToolCall] = field(default_factory=list)
    declarations: str = ""  # the Tools and Response Format sections of a system or developer turn
    declares_tools: bool = False
    task: str | None = None
    wo_eos: bool = False
    from_context: bool = False


def encode_messages(
    messages: Sequence[Mapping[str, Any]],
    thinking_mode: ThinkingMode,
    *,
    context: Sequence[Mapping[str, Any]] | None = None,
    drop_thinking: bool = True,
    add_default_bos_token: bool = True,
    reasoning_effort: str | None = None,
    profile: EffortProfile = "0731",
) -> str:
    """Render `messages` as DeepSeek-V4 prompt text (§5). With `context`, only `messages` are rendered, without BOS,
    but history dropping and the last-user logic see context and messages together."""
    if thinking_mode not in ("thinking", "chat"):
        raise ChatEncodingError("thinking_mode", f"expected 'thinking' or 'chat', got {thinking_mode!r}")
    thinking = thinking_mode == "thinking"
    effort_prefix = _effort_prefix(reasoning_effort, profile)

    turns = _read_turns(context or [], "context", from_context=True) + _read_turns(messages, "messages")
    _order_tool_results(turns)
    # §4: declared tools keep every turn's reasoning, as the hosted API requires it to be sent back with tools.
    drop = drop_thinking and not any(turn.declares_tools for turn in turns)
    if thinking and drop:
        turns = _drop_old_thinking(turns)
    last_user = _last_user_index(turns)

    prompt = [BOS] if add_default_bos_token and not context else []
    for index, turn in enumerate(turns):
        if turn.from_context:
            continue
        if index == 0 and thinking:
            prompt.append(effort_prefix)
        prompt.append(_render_turn(index, turns, thinking, drop, last_user))
    return "".join(prompt)


def declare(
    messages: Sequence[Any], tools: Sequence[Any], response_format: Mapping[str, Any] | None = None
) -> list[Any]:
    """The request's tools and response format go on the first system message, as the encoder expects (an empty
    system message is added when there is none)."""
    declarations = ({"tools": tools} if tools else {}) | (
        {"response_format": response_format} if response_format else {}
    )
    if not declarations:
        return list(messages)
    first = messages[0]
    if isinstance(first, Mapping) and first.get("role") == "system":
        return [{**first, **declarations}, *messages[1:]]
    return [{"role": "system", "content": "", **declarations}, *messages]


def _effort_prefix(level: Any, profile: str) -> str:
    if profile not in REASONING_EFFORT_PREFIXES:
        raise ChatEncodingError("profile", f"unknown checkpoint profile {profile!r}; expected '0731' or 'preview'")
    if level is None:
        return ""
    normalised = REASONING_EFFORT_ALIASES.get(level, level) if isinstance(level, str) else None
    if normalised not in REASONING_EFFORT_LEVELS:
        raise ChatEncodingError("reasoning_effort", f"unknown level {level!r}; expected 'low', 'high' or 'max'")
    return REASONING_EFFORT_PREFIXES[profile].get(normalised, "")


def _read_turns(raw_messages: Any, label: str, *, from_context: bool = False) -> list[_Turn]:
    """Validate messages and fold tool messages and adjacent user messages into user turns, as the vendor encoder
    merges them (§8): a tool result joins a preceding user turn, a user message one without a task."""
    if not isinstance(raw_messages, Sequence) or isinstance(raw_messages, str):
        raise ChatEncodingError(label, "expected a list of messages")
    turns: list[_Turn] = []
    for i, raw in enumerate(raw_messages):
        where = f"{label}[{i}]"
        if not isinstance(raw, Mapping):
            raise ChatEncodingError(where, "expected an object")
        role = raw.get("role")
        if role not in _ROLES:
            raise ChatEncodingError(f"{where}.role", f"unknown role {role!r}")
        task = raw.get("task")
        if task is not None and task not in TASK_TOKENS:
            raise ChatEncodingError(f"{where}.task", f"unknown task {task!r}; expected one of {sorted(TASK_TOKENS)}")
        previous = turns[-1] if turns else None

        if role == "tool":
            part = _Part(_tool_result(raw, where), tool_call_id=_optional_string(raw, "tool_call_id", where))
            if previous is not None and previous.role == "user":
                previous.parts.append(part)
            else:
                turns.append(_Turn("user", parts=[part], from_context=from_context))
            continue

        text = _content_text(raw.get("content"), f"{where}.content")
        if role == "user":
            if previous is not None and previous.role == "user" and previous.task is None:
                previous.parts.append(_Part(text))
                continue
            # Tools on a user message render nowhere but still keep reasoning (copy B, §11.5).
            turn = _Turn("user", parts=[_Part(text)], declares_tools=bool(raw.get("tools")), task=task)
        elif role in ("system", "developer"):
            if role == "developer" and not text:
                raise ChatEncodingError(f"{where}.content", "a developer message needs non-empty text")
            schemas = _tool_schemas(raw.get("tools"), f"{where}.tools")
            declarations = _declarations(raw, schemas, where)
            turn = _Turn(role, text=text, declarations=declarations, declares_tools=bool(schemas), task=task)
        elif role == "assistant":
            turn = _Turn(
                role,
                text=text,
                reasoning=_reasoning(raw, where),
                tool_calls=_tool_calls(raw.get("tool_calls"), f"{where}.tool_calls"),
                task=task,
                wo_eos=bool(raw.get("wo_eos")),
            )
        else:
            turn = _Turn(role, text=text, task=task)
        turn.from_context = from_context
        turns.append(turn)
    return turns


def _content_text(content: Any, where: str, *, tool_result: bool = False) -> str:
    """Text of a string or list-of-parts content, parts joined by a blank line. In a tool result a part that is not
    text becomes ``[Unsupported TYPE]`` (§8); elsewhere it is an error, as this model reads text only."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ChatEncodingError(where, "expected a string, null or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ChatEncodingError(f"{where}[{j}]", "expected a content part object")
        kind = part.get("type")
        if kind == "text":
            texts.append(_optional_string(part, "text", f"{where}[{j}]"))
        elif tool_result:
            texts.append(f"[Unsupported {kind}]")
        else:
            raise ChatEncodingError(f"{where}[{j}].type", f"unsupported content part {kind!r}; only text is accepted")
    return "\n\n".join(texts)


def _optional_string(raw: Mapping[str, Any], key: str, where: str) -> str:
    value = raw.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise ChatEncodingError(f"{where}.{key}", f"expected a string, got {type(value).__name__}")
    return value


def _tool_result(raw: Mapping[str, Any], where: str) -> str:
    text = _content_text(raw.get("content"), f"{where}.content", tool_result=True)
    if TOOL_RESULT_CLOSE in text:
        raise ChatEncodingError(f"{where}.content", f"contains {TOOL_RESULT_CLOSE!r}, which the format cannot escape")
    return TOOL_RESULT_OPEN + text + TOOL_RESULT_CLOSE


def _reasoning(raw: Mapping[str, Any], where: str) -> str:
    for name in _REASONING_FIELDS:
        if raw.get(name) is not None:
            return _optional_string(raw, name, where)
    return ""


def _json(value: Any, where: str) -> str:
    """§7: JSON with ", " and ": " separators and literal non-ASCII, keys in input order."""
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError) as error:
        raise ChatEncodingError(where, f"not serialisable as JSON ({error})") from None


def _tool_schemas(tools: Any, where: str) -> list[str]:
    """One JSON line per tool: the inner `function` object, without its `type` wrapper (§7)."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatEncodingError(where, "expected a list of tools")
    schemas = []
    for j, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping):
            raise ChatEncodingError(f"{where}[{j}].function", "expected an object")
        schemas.append(_json(function, f"{where}[{j}].function"))
    return schemas


def _declarations(raw: Mapping[str, Any], schemas: list[str], where: str) -> str:
    text = ""
    if schemas:
        text += "\n\n" + _TOOLS_SECTION.format(schemas="\n".join(schemas))
    if raw.get("response_format"):
        schema = _json(raw["response_format"], f"{where}.response_format")
        text += "\n\n" + _RESPONSE_FORMAT_SECTION.format(schema=schema)
    return text


def _tool_calls(calls: Any, where: str) -> list[_ToolCall]:
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ChatEncodingError(where, "expected a list of tool calls")
    rendered = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ChatEncodingError(f"{at}.function", "expected an object")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ChatEncodingError(f"{at}.function.name", "expected a non-empty string")
        if DSML in name or '"' in name:
            raise ChatEncodingError(f"{at}.function.name", f"{name!r} cannot be written inside a DSML tag")
        parameters = _dsml_parameters(function.get("arguments"), f"{at}.function.arguments")
        call_id = call.get("id") or function.get("id") or ""
        rendered.append(
            _ToolCall(
                id=call_id if isinstance(call_id, str) else "",
                invoke=f'{INVOKE_OPEN} name="{name}">\n{parameters}\n{INVOKE_CLOSE}',
            )
        )
    return rendered


def _dsml_parameters(arguments: Any, where: str) -> str:
    """§7 argument conversion: one parameter per key, strings raw with string="true", everything else as JSON
    with string="false"; with the §11.1 and §11.2 fixes described in the module docstring."""
    if isinstance(arguments, Mapping):
        values: Mapping[Any, Any] = arguments
    elif arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        values = {}
    elif isinstance(arguments, str):
        values = _decoded_arguments(arguments)
    else:
        raise ChatEncodingError(where, f"expected a JSON string or an object, got {type(arguments).__name__}")

    lines = []
    for key, value in values.items():
        is_string = isinstance(value, str)
        text = value if is_string else _json(value, f"{where}.{key}")
        if DSML in str(key) or '"' in str(key) or DSML in text:
            raise ChatEncodingError(f"{where}.{key}", "cannot be written inside a DSML parameter (no escaping, §11.4)")
        string = "true" if is_string else "false"
        lines.append(f'{PARAMETER_OPEN} name="{key}" string="{string}">{text}{PARAMETER_CLOSE}')
    return "\n".join(lines)


def _decoded_arguments(arguments: str) -> Mapping[str, Any]:
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return {"arguments": arguments}
    if decoded is None:
        return {}
    if isinstance(decoded, dict):
        return decoded
    return {"arguments": arguments}


def _order_tool_results(turns: list[_Turn]) -> None:
    """§8: a user turn's tool results follow the call order of the latest assistant turn with calls (a stable
    sort; an unknown id ranks as the first call)."""
    call_order: dict[str, int] = {}
    for turn in turns:
        if turn.role == "assistant" and turn.tool_calls:
            call_order = {call.id: rank for rank, call in enumerate(turn.tool_calls) if call.id}
        elif turn.role == "user" and call_order:
            results = [part for part in turn.parts if part.tool_call_id is not None]
            if len(results) > 1:
                ranked = iter(_by_call_order(results, call_order))
                turn.parts = [next(ranked) if part.tool_call_id is not None else part for part in turn.parts]


def _by_call_order(results: list[_Part], call_order: dict[str, int]) -> list[_Part]:
    return sorted(results, key=lambda part: call_order.get(part.tool_call_id or "", 0))


def _last_user_index(turns: list[_Turn]) -> int:
    """L of §4: the last user or developer turn (tool results count as user turns), -1 when there is none."""
    return max((i for i, turn in enumerate(turns) if turn.role in ("user", "developer")), default=-1)


def _drop_old_thinking(turns: list[_Turn]) -> list[_Turn]:
    """§4: before the last user turn, assistant turns lose their reasoning and developer turns disappear."""
    last_user = _last_user_index(turns)
    kept = []
    for index, turn in enumerate(turns):
        if index >= last_user or turn.role in ("system", "user", "latest_reminder"):
            kept.append(turn)
        elif turn.role == "assistant":
            kept.append(replace(turn, reasoning=""))
    return kept


def _render_turn(index: int, turns: list[_Turn], thinking: bool, drop: bool, last_user: int) -> str:
    turn = turns[index]
    if turn.role == "system":
        text = turn.text + turn.declarations
    elif turn.role == "developer":
        text = USER + turn.text + turn.declarations
    elif turn.role == "user":
        text = USER + "\n\n".join(part.text for part in turn.parts)
    elif turn.role == "latest_reminder":
        text = LATEST_REMINDER + turn.text
    else:
        # The answer to a quick-instruction task never has a reasoning part (§9).
        answers_task = index > 0 and turns[index - 1].task is not None
        keeps_reasoning = thinking and not answers_task and (not drop or index > last_user)
        text = (turn.reasoning + THINK_END if keeps_reasoning else "") + turn.text + _tool_call_block(turn)
        if not turn.wo_eos:
            text += EOS
    return text + _generation_suffix(index, turns, thinking, drop, last_user)


def _tool_call_block(turn: _Turn) -> str:
    """§7: two newlines, then the invokes inside one tool_calls element."""
    if not turn.tool_calls:
        return ""
    invokes = "\n".join(call.invoke for call in turn.tool_calls)
    return f"\n\n{TOOL_CALLS_OPEN}\n{invokes}\n{TOOL_CALLS_CLOSE}"


def _generation_suffix(index: int, turns: list[_Turn], thinking: bool, drop: bool, last_user: int) -> str:
    """§3 and §9: what follows a turn that is last, or followed by an assistant or latest_reminder turn."""
    following = turns[index + 1].role if index + 1 < len(turns) else None
    if following not in (None, "assistant", "latest_reminder"):
        return ""
    turn = turns[index]
    if turn.task == "action":
        return ASSISTANT + (THINK_START if thinking else THINK_END) + TASK_TOKENS["action"]
    if turn.task is not None:
        return TASK_TOKENS[turn.task]
    if turn.role in ("user", "developer"):
        opens_thinking = thinking and (not drop or index >= last_user)
        return ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return ""
