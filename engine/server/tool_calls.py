"""The tools a chat request offers, its `tool_choice`, and the DSML tool-call block they allow, as an xgrammar
structural-tag format (shared/reference/dsv4-chat-format.md §7).

The block format is the one the encoder writes and `dsml.py` parses, byte for byte: two newlines, the
``<｜DSML｜tool_calls>`` element, one ``<｜DSML｜invoke name="…">`` element per call joined by a newline, and inside
each invoke its parameters, each on its own line, in the order the schema declares them. A string parameter is
written raw with ``string="true"``, as the encoder writes it: any text, one of its `enum` strings, or text matching
its `pattern` or its length limits; only a string with a `format` (or with limits a regex cannot join) is written
as a JSON string. Any other value is JSON matching its sub-schema with ``string="false"``, which the parser passes
through verbatim. Required parameters must appear, others may; no undeclared parameter can. No free text or string
value may hold ``｜DSML｜``, ``<think>`` or ``</think>``, which would end or void the call when it is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from xgrammar.structural_tag import (
    AnyTextFormat,
    ConstStringFormat,
    Format,
    JSONSchemaFormat,
    OptionalFormat,
    OrFormat,
    RegexFormat,
    SequenceFormat,
    TagFormat,
    TagsWithSeparatorFormat,
)

from engine.server.chat_encoding import (
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAMETER_CLOSE,
    PARAMETER_OPEN,
    THINK_END,
    THINK_START,
    TOOL_CALLS_CLOSE,
    TOOL_CALLS_OPEN,
)

# Markup that must never appear inside free text or a string value (see the module docstring).
EXCLUDED_TEXT = [DSML, THINK_START, THINK_END]
# Under tool_choice "none" the bare keyword too: no call is wanted, so not even a fragment of its markup (a tag
# with a bar missing, one cut by the token budget) may reach the content.
EXCLUDED_TEXT_UNDER_NONE = ["DSML", THINK_START, THINK_END]
# The encoder writes argument JSON with ", " and ": ": one space between tokens is all a call needs.
_PARAMETER_WHITESPACE = 1
# A string schema with only these keys is "any text": written raw.
_PLAIN_STRING_KEYS = {"type", "description", "title", "default", "examples", "$comment"}
# xgrammar writes a string with a length limit as raw characters that may include control characters (invalid
# JSON) and drops the limit when it also excludes substrings; a pattern of plain characters does neither.
_LENGTH_KEYS = ("minLength", "maxLength")
_PLAIN_CHARACTERS = '[^\\x00-\\x1f"\\\\｜]'

ToolChoiceMode = Literal["auto", "none", "required", "named"]


class ToolsError(ValueError):
    """A `tools` or `tool_choice` the server cannot use; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Tool:
    name: str
    parameters: Mapping[str, Any]  # a JSON Schema for the arguments object
    strict: bool


@dataclass(frozen=True)
class ToolPolicy:
    """What a request allows: the tools offered, which of them may or must be called, and how many at once."""

    tools: tuple[Tool, ...] = ()
    choice: ToolChoiceMode = "auto"
    named: str | None = None  # the one tool `choice == "named"` calls
    parallel: bool = True

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        if self.choice == "none":
            return ()
        if self.choice == "named":
            return tuple(tool for tool in self.tools if tool.name == self.named)
        return self.tools


def parse_tool_policy(body: Mapping[str, Any]) -> ToolPolicy:
    """`tools` (OpenAI's chat shape `{type: "function", function: {name, parameters, strict}}`), `tool_choice`
    (`auto`, `none`, `required`, or `{type: "function", function: {name}}`; the Responses shape `{type: "function",
    name}` too) and `parallel_tool_calls`. An empty `tools` array is no tools."""
    raw_tools = body.get("tools")
    if raw_tools is None:
        raw_tools = []
    if not isinstance(raw_tools, list):
        raise ToolsError("tools must be an array of tools", "tools")
    tools = tuple(_tool(raw, f"tools[{i}]") for i, raw in enumerate(raw_tools))
    names = [tool.name for tool in tools]
    if len(set(names)) != len(names):
        raise ToolsError(f"tool names must be unique, got {names}", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ToolsError(f"parallel_tool_calls must be a boolean, got {parallel!r}", "parallel_tool_calls")
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return ToolPolicy(tools, "auto", None, parallel is not False)
    if choice in ("none", "required"):
        if choice == "required" and not tools:
            raise ToolsError("tool_choice 'required' needs at least one tool in tools", "tool_choice")
        return ToolPolicy(tools, choice, None, parallel is not False)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
        if name not in names:
            raise ToolsError(f"tool_choice names {name!r}, which is not among the tools {names}", "tool_choice")
        return ToolPolicy(tools, "named", name, parallel is not False)
    raise ToolsError(
        f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'function': {{'name': …}}}}, "
        f"got {choice!r}",
        "tool_choice",
    )


def _tool(raw: Any, where: str) -> Tool:
    function = raw.get("function") if isinstance(raw, Mapping) else None
    if not isinstance(function, Mapping) or raw.get("type", "function") != "function":
        raise ToolsError(f"{where} must be {{'type': 'function', 'function': {{'name': …}}}}", where)
    name = function.get("name")
    if not isinstance(name, str) or not name or '"' in name or DSML in name or "\n" in name:
        raise ToolsError(
            f"{where}.function.name must be a non-empty name without quotes or newlines", f"{where}.function.name"
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolsError(f"{where}.function.description must be a string", f"{where}.function.description")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping):
        raise ToolsError(f"{where}.function.parameters must be a JSON Schema object", f"{where}.function.parameters")
    properties, required = parameters.get("properties"), parameters.get("required")
    if properties is not None and not (
        isinstance(properties, Mapping) and all(isinstance(p, Mapping | bool) for p in properties.values())
    ):
        raise ToolsError(
            f"{where}.function.parameters.properties must be an object of JSON Schemas",
            f"{where}.function.parameters.properties",
        )
    if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
        raise ToolsError(
            f"{where}.function.parameters.required must be an array of property names",
            f"{where}.function.parameters.required",
        )
    return Tool(name, parameters, function.get("strict") is True)


def block_format(tools: Sequence[Tool], parallel: bool) -> Format:
    """One DSML tool-call block calling `tools` (one call, or several when `parallel`), from the two newlines that
    open it to its closing tag."""
    invokes = TagsWithSeparatorFormat(
        tags=[_invoke(tool) for tool in tools], separator="\n", at_least_one=True, stop_after_first=not parallel
    )
    return SequenceFormat(
        elements=[
            ConstStringFormat(value=f"\n\n{TOOL_CALLS_OPEN}\n"),
            invokes,
            ConstStringFormat(value=f"\n{TOOL_CALLS_CLOSE}"),
        ]
    )


def _invoke(tool: Tool) -> TagFormat:
    return TagFormat(begin=f'{INVOKE_OPEN} name="{tool.name}">', content=_parameters(tool), end=f"\n{INVOKE_CLOSE}")


def _parameters(tool: Tool) -> Format:
    """Each parameter on a line of its own: "\\n" before each; a tool without parameters gets the blank line the
    encoder writes."""
    schema = tool.parameters
    properties = schema.get("properties") or {}
    if not properties:
        return ConstStringFormat(value="\n")
    required = set(schema.get("required") or [])
    definitions = {key: schema[key] for key in ("$defs", "definitions") if key in schema}
    elements: list[Format] = []
    for key, sub_schema in properties.items():
        if '"' in key or DSML in key or not isinstance(sub_schema, Mapping | bool):
            raise ToolsError(f"tool {tool.name!r}: parameter {key!r} cannot be written in a DSML call", "tools")
        line = SequenceFormat(elements=[ConstStringFormat(value="\n"), _parameter(key, sub_schema, definitions)])
        elements.append(line if key in required else OptionalFormat(content=line))
    return SequenceFormat(elements=elements)


def _parameter(key: str, schema: Mapping[str, Any] | bool, definitions: Mapping[str, Any]) -> Format:
    head = f'{PARAMETER_OPEN} name="{key}" string='
    if isinstance(schema, Mapping) and schema.get("type") == "string" and set(schema) <= _PLAIN_STRING_KEYS:
        return TagFormat(begin=f'{head}"true">', content=AnyTextFormat(excludes=EXCLUDED_TEXT), end=PARAMETER_CLOSE)
    if (raw := _raw_string(schema)) is not None:
        return SequenceFormat(
            elements=[ConstStringFormat(value=f'{head}"true">'), raw, ConstStringFormat(value=PARAMETER_CLOSE)]
        )
    value = json_format({**schema, **definitions} if isinstance(schema, Mapping) else schema, _PARAMETER_WHITESPACE)
    return SequenceFormat(
        elements=[ConstStringFormat(value=f'{head}"false">'), value, ConstStringFormat(value=PARAMETER_CLOSE)]
    )


def _raw_string(schema: Mapping[str, Any] | bool) -> Format | None:
    """The raw text of a string parameter whose limits a regex can state: a choice of strings (`enum`, `const`),
    a `pattern`, or length limits; None for what is written as JSON."""
    if not isinstance(schema, Mapping):
        return None
    limits = set(schema) - _PLAIN_STRING_KEYS
    choices = schema["enum"] if limits == {"enum"} else [schema["const"]] if limits == {"const"} else None
    if isinstance(choices, list) and choices and all(_raw_choice(choice) for choice in choices):
        return OrFormat(elements=[ConstStringFormat(value=choice) for choice in choices])
    if schema.get("type") != "string":
        return None
    if limits == {"pattern"} and isinstance(schema["pattern"], str):
        return RegexFormat(pattern=schema["pattern"])
    if limits and limits <= set(_LENGTH_KEYS):
        return RegexFormat(pattern=f"[^｜]{{{schema.get('minLength', 0)},{schema.get('maxLength', '')}}}")
    return None


def _raw_choice(choice: Any) -> bool:
    return isinstance(choice, str) and bool(choice) and not any(text in choice for text in EXCLUDED_TEXT)


def json_format(
    schema: Mapping[str, Any] | bool, max_whitespace: int | None, excludes: Sequence[str] = EXCLUDED_TEXT
) -> JSONSchemaFormat:
    """JSON matching `schema`, its strings free of `excludes` (a string with a `pattern` or `format` is held to
    that alone)."""
    return JSONSchemaFormat(
        json_schema=_length_limits_as_patterns(schema), excludes=list(excludes), max_whitespace_cnt=max_whitespace
    )


def _length_limits_as_patterns(schema: Any) -> Any:
    """`schema` with each string length limit written as a pattern of that many plain characters (no control
    character, quote, backslash or ``｜``), which xgrammar applies exactly."""
    if isinstance(schema, list):
        return [_length_limits_as_patterns(item) for item in schema]
    if not isinstance(schema, Mapping):
        return schema
    rewritten = {key: _length_limits_as_patterns(value) for key, value in schema.items()}
    limits = [schema.get(key) for key in _LENGTH_KEYS]
    if any(isinstance(limit, int) for limit in limits) and "pattern" not in schema and "format" not in schema:
        low, high = (limit if isinstance(limit, int) else None for limit in limits)
        for key in _LENGTH_KEYS:
            rewritten.pop(key, None)
        rewritten["pattern"] = f"^{_PLAIN_CHARACTERS}{{{low or 0},{'' if high is None else high}}}$"
    return rewritten
