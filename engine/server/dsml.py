"""DeepSeek-V4 completion parsing: reasoning, content and DSML tool calls, from whole text or from stream deltas.

Implements shared/reference/dsv4-chat-format.md §10 (the completion's shape, the reference parser's grammar and
the arguments string), tolerant where §10 and §12 allow and never inventing a call:

1. In thinking mode the reasoning is the text before the first ``</think>`` and the content follows it; with no
   ``</think>`` everything is reasoning (e.g. the length limit cut it). In chat mode everything is content.
2. EOS ends the completion. It may be missing, since servers strip the stop token: the end of the text counts as
   EOS. Text after EOS is dropped.
3. With no tools offered there is no tool parsing at all: DSML markup is plain content.
4. With tools offered, a tool-call block starts at ``\\n\\n<｜DSML｜tool_calls`` in the content (the two newlines
   belong to the block) and ends at the first ``</｜DSML｜tool_calls>``. Its calls are emitted, together and in
   order, only once the block parses under the reference grammar (§10 rule 3), every ``string="false"`` value is
   one JSON value (the reference does not check; §10), no name, key or value holds ``｜DSML｜``, and nothing but
   whitespace then EOS, or the end, follows it (§10 rule 4). A block is accepted or dropped whole.
5. DSML markup never reaches reasoning, content or arguments. A block that fails rule 4 or is never closed, a
   block inside the reasoning, and any ``｜DSML｜`` tag without the blank-line start are each dropped and reported
   as `Malformed` (its text and why). A dropped region runs from its first marker to the first
   ``</｜DSML｜tool_calls>`` (or to EOS, or the end), and parsing resumes after it where it was. So the
   ``parse_error_*`` vectors give content-only results and never a call (§12).
6. Streaming holds back any text that could be the start of a marker, so the events never depend on how the
   text was split: any split fed to `StreamingParser` gives what `parse_completion` gives.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from engine.server.chat_encoding import DSML, EOS, THINK_END, TOOL_CALLS_CLOSE

# The two newlines before the block belong to it, not to the content (§10 rule 2).
BLOCK_START = f"\n\n<{DSML}tool_calls"
# Any of these outside an accepted block is markup that must not leak (rule 5), including tags with the doubled
# bars that real outputs show (§10), so that their "<｜" goes with them.
_MARKUP = (BLOCK_START, f"<{DSML}", f"</{DSML}", f"<｜{DSML}", f"</｜{DSML}", DSML)
# The reference grammar's stops (§10 rule 3). Closing tags are found without their ">", which the separator
# check that follows then requires, as in the reference parser.
_INVOKE_OPEN = f"<{DSML}invoke"
_INVOKE_END = f"</{DSML}invoke"
_PARAMETER_OPEN = f"<{DSML}parameter"
_PARAMETER_END = f"/{DSML}parameter"
_SEPARATOR = ">\n"
# The reference matches these with "$", which also matches before one final newline: that is how it accepts the
# blank line the encoder writes inside a call without arguments.
_INVOKE_HEAD = re.compile(r'\s*name="(.*?)">\n\n?', re.DOTALL)
_PARAMETER = re.compile(r' name="(.*?)" string="(true|false)">(.*?)<\n?', re.DOTALL)

_State = Literal["reasoning", "content", "block", "after_block", "done"]


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCall:
    """A complete, valid call. `arguments` is a JSON object as text, written as §10 "Arguments string" says."""

    index: int
    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Malformed:
    """Output that was dropped rather than shown (rule 5, or text after EOS), and why."""

    text: str
    reason: str


StreamEvent = ReasoningDelta | ContentDelta | ToolCall | Malformed


@dataclass
class ParsedCompletion:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    malformed: list[Malformed] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_output(
    text: str, tools_offered: bool, thinking: bool, *, call_id: Callable[[], str] = new_call_id
) -> ParsedCompletion:
    """Parse a whole completion's text (with or without its EOS)."""
    parser = StreamingParser(tools_offered=tools_offered, thinking=thinking, call_id=call_id)
    result = ParsedCompletion()
    reasoning: list[str] = []
    content: list[str] = []
    for event in parser.feed(text) + parser.finish():
        if isinstance(event, ReasoningDelta):
            reasoning.append(event.text)
        elif isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCall):
            result.tool_calls.append(event)
        else:
            result.malformed.append(event)
    result.reasoning, result.content = "".join(reasoning), "".join(content)
    return result


class StreamingParser:
    """Parses one completion incrementally: `feed` each text delta, then call `finish` once. Both return the
    events that became certain: reasoning and content deltas, each tool call once whole, and dropped markup."""

    def __init__(self, *, tools_offered: bool, thinking: bool, call_id: Callable[[], str] = new_call_id) -> None:
        markup = _MARKUP if tools_offered else ()
        self._markers: dict[str, tuple[str, ...]] = {"reasoning": (THINK_END, EOS, *markup), "content": (EOS, *markup)}
        self._call_id = call_id
        self._state: _State = "reasoning" if thinking else "content"
        self._pending = ""  # text received and not yet consumed
        self._searched = 0  # in a block: how much of _pending was already searched for the block's end
        self._block_origin: _State = "content"
        self._block_is_call = False
        self._block = ""  # an accepted block waiting for EOS
        self._calls: list[tuple[str, str]] = []  # its (name, arguments)
        self._next_index = 0
        self._events: list[StreamEvent] = []
        self._finished = False

    def feed(self, delta: str) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += delta
        self._run(at_end=False)
        return self._take_events()

    def finish(self) -> list[StreamEvent]:
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._run(at_end=True)
        if self._pending:
            self._events.append(Malformed(self._pending, "text after the end of sentence"))
            self._pending = ""
        return self._take_events()

    def _take_events(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        return events

    def _run(self, at_end: bool) -> None:
        while self._state != "done" and self._step(at_end):
            pass

    def _step(self, at_end: bool) -> bool:
        if self._state == "block":
            return self._scan_block(at_end)
        if self._state == "after_block":
            return self._scan_after_block(at_end)
        return self._scan_text(at_end)

    def _scan_text(self, at_end: bool) -> bool:
        """Emit reasoning or content up to the next marker; returns whether the state changed."""
        text, markers = self._pending, self._markers[self._state]
        position, marker = _first_marker(text, markers)
        # A marker may still grow into a longer one that starts earlier (``<｜DSML｜`` inside ``\n\n<｜DSML｜…``).
        undecided = len(text) - (0 if at_end else _partial_marker_length(text, markers))
        if marker is None or undecided <= position:
            self._emit(text[:undecided])
            self._pending = text[undecided:]
            return False
        self._emit(text[:position])
        if marker == THINK_END:
            self._pending, self._state = text[position + len(marker) :], "content"
        elif marker == EOS:
            self._pending, self._state = text[position + len(marker) :], "done"
        else:
            self._block_origin, self._block_is_call = self._state, marker == BLOCK_START and self._state == "content"
            self._pending, self._searched, self._state = text[position:], 0, "block"
        return True

    def _scan_block(self, at_end: bool) -> bool:
        """Wait for the end of a block or markup region; accept its calls or drop it (rules 4 and 5)."""
        text = self._pending
        start = max(0, self._searched - len(EOS))
        close, eos = text.find(TOOL_CALLS_CLOSE, start), text.find(EOS, start)
        if close >= 0 and (eos < 0 or close < eos):
            end = close + len(TOOL_CALLS_CLOSE)
            block, self._pending = text[:end], text[end:]
            if self._block_is_call:
                try:
                    self._calls = _parse_block(block)
                except _BlockError as error:
                    self._drop(block, str(error))
                else:
                    self._block, self._state = block, "after_block"
                    return True
            else:
                self._drop(block, self._markup_reason())
        elif eos >= 0 or at_end:
            end = eos if eos >= 0 else len(text)
            self._drop(text[:end], "tool-call block not closed" if self._block_is_call else self._markup_reason())
            self._pending = text[end:]
        else:
            self._searched = len(text)
            return False
        self._state = self._block_origin
        return True

    def _scan_after_block(self, at_end: bool) -> bool:
        """Only whitespace and then EOS, or the end, may follow an accepted block (§10 rule 4)."""
        tail = self._pending.lstrip()
        if tail.startswith(EOS) or (at_end and not tail):
            for name, arguments in self._calls:
                self._events.append(ToolCall(self._next_index, self._call_id(), name, arguments))
                self._next_index += 1
            self._pending, self._state = tail[len(EOS) :], "done"
            return True
        if not at_end and EOS.startswith(tail):
            return False
        self._drop(self._block, "text after the tool-call block")
        self._state = "content"
        return True

    def _markup_reason(self) -> str:
        if self._block_origin == "reasoning":
            return "DSML markup inside the reasoning"
        return "DSML markup outside a tool-call block"

    def _emit(self, text: str) -> None:
        if text:
            self._events.append(ReasoningDelta(text) if self._state == "reasoning" else ContentDelta(text))

    def _drop(self, text: str, reason: str) -> None:
        self._events.append(Malformed(text, reason))


def _first_marker(text: str, markers: tuple[str, ...]) -> tuple[int, str | None]:
    """The earliest marker in `text` and its position; at one position the longest."""
    found: list[tuple[int, int, str]] = []
    for marker in markers:
        position = text.find(marker)
        if position >= 0:
            found.append((position, -len(marker), marker))
    if not found:
        return len(text), None
    position, _, marker = min(found)
    return position, marker


def _partial_marker_length(text: str, markers: tuple[str, ...]) -> int:
    """The longest end of `text` that is a proper prefix of a marker: text to hold back until the next delta."""
    longest = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:size]):
                longest = size
                break
    return longest


class _BlockError(ValueError):
    pass


def _read_until(text: str, index: int, stops: tuple[str, ...]) -> tuple[int, str, str | None]:
    """The reference parser's reader: the text up to the earliest stop, and the index after that stop."""
    position, stop = _first_marker(text[index:], stops)
    if stop is None:
        return len(text), text[index:], None
    return index + position + len(stop), text[index : index + position], stop


def _parse_block(block: str) -> list[tuple[str, str]]:
    """(name, arguments) of each call in a block that starts with BLOCK_START and ends with the first
    ``</｜DSML｜tool_calls>``: the reference grammar (§10 rule 3) plus the checks of rule 4."""
    calls = []
    index = len(BLOCK_START)
    while True:
        index, between, stop = _read_until(block, index, (_INVOKE_OPEN, TOOL_CALLS_CLOSE))
        if between != _SEPARATOR:
            raise _BlockError(f"expected '>\\n' between tags, got {between!r}")
        if stop == TOOL_CALLS_CLOSE:
            return calls
        index, head, stop = _read_until(block, index, (_PARAMETER_OPEN, _INVOKE_END))
        match = _INVOKE_HEAD.fullmatch(head)
        if stop is None or match is None or not match[1] or DSML in match[1]:
            raise _BlockError(f"invoke tag format error: {head!r}")
        parameters: dict[str, tuple[str, bool]] = {}
        while stop == _PARAMETER_OPEN:
            index, body, stop = _read_until(block, index, (_PARAMETER_END,))
            parameter = _PARAMETER.fullmatch(body)
            if stop is None or parameter is None:
                raise _BlockError(f"parameter format error: {body!r}")
            key, value = parameter[1], parameter[3]
            if key in parameters:
                raise _BlockError(f"duplicate parameter name {key!r}")
            parameters[key] = (value, parameter[2] == "true")
            index, between, stop = _read_until(block, index, (_PARAMETER_OPEN, _INVOKE_END))
            if stop is None or between != _SEPARATOR:
                raise _BlockError(f"expected '>\\n' after parameter {key!r}, got {between!r}")
        calls.append((match[1], _arguments(parameters)))


def _arguments(parameters: dict[str, tuple[str, bool]]) -> str:
    """§10: ``{`` + ``"key": value`` entries joined by ", " + ``}``; a string="true" value JSON-quoted with literal
    Unicode, a string="false" value verbatim once it is checked to be one strict JSON value."""
    entries = []
    for key, (value, is_string) in parameters.items():
        if DSML in key or DSML in value:
            raise _BlockError(f"DSML markup inside parameter {key!r}")
        if not is_string:
            try:
                json.loads(value, parse_constant=_reject_constant)
            except ValueError:
                raise _BlockError(f'parameter {key!r} is string="false" but not JSON: {value!r}') from None
        text = json.dumps(value, ensure_ascii=False) if is_string else value
        entries.append(f"{json.dumps(key, ensure_ascii=False)}: {text}")
    return "{" + ", ".join(entries) + "}"


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
