"""Constrained decoding with xgrammar: a request's output grammar, compiled once, applied as a logits mask in the
sampler, with a forced ending so that the output is valid within the request's token budget.

What is constrained (docs/agent-api.md, "Constrained decoding"):

- `tool_choice` `required` or named: the completion is one DSML tool-call block (`tool_calls.block_format`) calling
  any offered tool, or the named one, with arguments that follow each tool's JSON Schema.
- `tool_choice` `auto` with a `strict` tool: free text, optionally followed by such a block.
- `tool_choice` `none` with tools: free text (or the JSON content) without ``DSML`` anywhere, so not even a
  fragment of a call's markup, whatever the sampling.
- `response_format` `json_object` / `json_schema`: the content is JSON matching the schema (or, with callable tools
  under `auto`, a tool-call block instead).

In thinking mode the grammar starts after ``</think>``: reasoning is free (no mask, no cost) except that EOS is
masked when the grammar cannot be empty, and so is any token holding ``｜DSML｜``, which would swallow the calls
that follow when the completion is parsed.

The forced ending. A grammar guarantees a valid prefix, not an ending. So the constraint always holds one valid
ending from the current state, as tokens ending in EOS, found by the closer below; call its length the reserve.
While reasoning, the reserve also counts the tokens of ``</think>``. When the tokens left (`max_tokens` minus
those generated) reach the reserve, decoding follows the held ending token by token (closing the reasoning first).
A sampled token whose own ending would no longer fit in what is left after it is replaced by the held ending's
first token. So the output completes the grammar within `max_tokens` whenever the ending from the grammar's start
fits (a tiny random model included); when even that does not fit, the output is cut as usual (`length`).

The closer finds an ending greedily, piece by piece: EOS once the grammar is complete; otherwise the text the
grammar forces; else the first closing string the grammar accepts (inside free text, a string or a raw parameter
value: a closing quote or tag that leaves the free text; elsewhere: a tag, bracket or brace close, then the
shortest values and separators); and failing those, the shortest allowed token. It is short, not always the
shortest.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
import torch
import xgrammar as xgr
from xgrammar.structural_tag import (
    AnyTextFormat,
    Format,
    OptionalFormat,
    OrFormat,
    SequenceFormat,
    StructuralTag,
)

from engine.server.chat_encoding import DSML, INVOKE_CLOSE, PARAMETER_CLOSE, THINK_END, TOOL_CALLS_CLOSE
from engine.server.tool_calls import EXCLUDED_TEXT, EXCLUDED_TEXT_UNDER_NONE, ToolPolicy, block_format, json_format
from engine.tokenizer import Tokenizer

log = structlog.get_logger(__name__)

# A character that only free text accepts (never JSON structure, a property name or a tag).
_FREE_TEXT_PROBE = "§"
# Inside free text: what may end it.
_TERMINATORS = ('"', PARAMETER_CLOSE)
# Elsewhere, in this order: closes first, then the shortest values and separators. A tag close starts after "<",
# which the grammar forces where a tag may open or close.
_CLOSERS = (
    "}",
    "]",
    PARAMETER_CLOSE,
    INVOKE_CLOSE[1:],
    TOOL_CALLS_CLOSE[1:],
    '"',
    "0",
    ":",
    ",",
    "null",
    "true",
    "[",
    "{",
)
_XGRAMMAR_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
# An ending longer than this many pieces means the closer is lost (it never is for the grammars built here).
_MAX_CLOSER_PIECES = 512


class GrammarError(ValueError):
    """A schema xgrammar cannot compile, or a grammar the closer cannot end."""


def output_format(policy: ToolPolicy, response_schema: Mapping[str, Any] | bool | None) -> Format | None:
    """The completion's format (after any reasoning), or None when nothing constrains it (see the module doc)."""
    callable_tools = policy.callable_tools
    excludes = EXCLUDED_TEXT_UNDER_NONE if policy.choice == "none" and policy.tools else EXCLUDED_TEXT
    if response_schema is not None:
        text: Format = json_format(response_schema, None, excludes)
    else:
        text = AnyTextFormat(excludes=excludes)
    if policy.choice in ("required", "named"):
        return block_format(callable_tools, policy.parallel)
    if not callable_tools:
        return text if response_schema is not None or policy.tools else None
    block = block_format(callable_tools, policy.parallel)
    if response_schema is not None:
        return OrFormat(elements=[text, block])
    if any(tool.strict for tool in callable_tools):
        return SequenceFormat(elements=[text, OptionalFormat(content=block)])
    return None


class Grammars:
    """xgrammar's view of the vocabulary and a compiler, built once at boot."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        token_bytes = tokenizer.token_bytes()
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.eos_id
        self.vocab_size = vocab_size
        # Empty bytes mark a control token, which xgrammar never allows; ids past the tokenizer's are padding.
        self.info = xgr.TokenizerInfo(
            [piece or b"" for piece in token_bytes],
            xgr.VocabType.RAW,
            vocab_size=vocab_size,
            stop_token_ids=[tokenizer.eos_id],
        )
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self.token_bytes = [*token_bytes, *[None] * (vocab_size - len(token_bytes))]
        self.think_end = tokenizer.encode(THINK_END)
        dsml = DSML.encode()
        self.markup_ids = [i for i, piece in enumerate(self.token_bytes) if piece and dsml in piece]
        # The closer's last resort takes the first allowed token in this order: shortest, printable ASCII first,
        # whitespace last among those (it never ends anything).
        self.fallback_order = torch.tensor(
            sorted(
                (i for i, piece in enumerate(self.token_bytes) if piece),
                key=lambda i: (len(self.token_bytes[i]), _fallback_rank(self.token_bytes[i]), self.token_bytes[i]),
            )
        )
        self._bits = torch.arange(32, dtype=torch.int32)

    def constraint(self, fmt: Format, thinking: bool) -> GrammarConstraint:
        try:
            compiled = self.compiler.compile_structural_tag(StructuralTag(format=fmt))
        except (RuntimeError, ValueError) as error:
            reason = _XGRAMMAR_LOG_PREFIX.sub("", str(error).strip())  # "[time] file.cc:line: " says nothing here
            raise GrammarError(f"cannot build the output grammar: {reason}") from error
        return GrammarConstraint(self, compiled, thinking)

    def tokens(self, pieces: Sequence[str | int]) -> list[int]:
        """Token ids for an ending: text pieces encoded together, token pieces as they are."""
        ids: list[int] = []
        text = ""
        for piece in pieces:
            if isinstance(piece, str):
                text += piece
                continue
            ids += self.tokenizer.encode(text) + [piece]
            text = ""
        return ids + self.tokenizer.encode(text)

    def allowed(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A bitmask row unpacked to one bool per token id."""
        bits = (bitmask[0].unsqueeze(-1) >> self._bits) & 1
        return bits.flatten()[: self.vocab_size].bool()


class GrammarConstraint:
    """One request's grammar state (an `engine.sampler.Constraint`): the matcher, the phase (reasoning or not) and
    the ending it holds. Built by the server, then used by the engine thread alone."""

    def __init__(self, grammars: Grammars, compiled: xgr.CompiledGrammar, thinking: bool):
        self.grammars = grammars
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, grammars.vocab_size)
        self.reasoning = thinking
        self.tail = b""  # the reasoning's last bytes, where ``</think>`` may be forming
        self.forced: list[int] = []
        self.abandoned = False
        ending = self._ending()
        if ending is None:
            raise GrammarError("the output grammar has no ending the server can find")
        self.ending = ending
        self.reasoning_may_stop = self.matcher.is_completed()

    def next_token(self, logits: torch.Tensor, remaining: int, draw: Callable[[torch.Tensor], int]) -> int:
        """The next token: forced when the budget says so, else drawn from the masked logits."""
        if self.abandoned or self.matcher.is_terminated():  # past EOS only under ignore_eos
            return draw(logits)
        reserve = len(self.ending) + (len(self.grammars.think_end) if self.reasoning else 0)
        if not self.forced and remaining <= reserve:
            self.forced = (self.grammars.think_end if self.reasoning else []) + self.ending
        if self.forced:
            token = self.forced.pop(0)
            self._accept(token)
            return token
        if self.reasoning:
            token = draw(self._reasoning_mask(logits))
            self._accept(token)
            return token
        self.matcher.fill_next_token_bitmask(self.bitmask)
        masked = logits.clone()
        xgr.apply_token_bitmask_inplace(masked, self.bitmask)
        token = draw(masked)
        held = self.ending
        self.matcher.accept_token(token)
        ending = held[1:] if held[0] == token else held if self._still_ends(held) else self._ending()
        if ending is None or len(ending) > remaining - 1:
            # This token leaves no room to finish: take the held ending instead.
            self.matcher.rollback(1)
            self.forced = list(held)
            token = self.forced.pop(0)
            self.matcher.accept_token(token)
            return token
        self.ending = ending
        return token

    def _reasoning_mask(self, logits: torch.Tensor) -> torch.Tensor:
        masked = logits.clone()
        masked[self.grammars.markup_ids] = float("-inf")
        if not self.reasoning_may_stop:
            masked[self.grammars.eos_id] = float("-inf")
        return masked

    def _accept(self, token: int) -> None:
        if not self.reasoning:
            self.matcher.accept_token(token)
            return
        marker = THINK_END.encode()
        self.tail += self.grammars.token_bytes[token] or b""
        at = self.tail.find(marker)
        if at < 0:
            self.tail = self.tail[-(len(marker) - 1) :]
            return
        self.reasoning = False
        rest = self.tail[at + len(marker) :]
        if rest and not (self.matcher.accept_string(rest) and (ending := self._ending()) is not None):
            # The token that closed the reasoning carried text the grammar refuses: the answer cannot be valid.
            log.warning("grammar_abandoned", reason="text after </think> breaks the grammar", text=rest[:80])
            self.abandoned = True
        elif rest:
            self.ending = ending

    def _still_ends(self, ending: list[int]) -> bool:
        """Whether `ending` also ends the grammar from the matcher's new state, as it does after a token of free
        text (the same closing quote or tag still closes it)."""
        matcher = self.matcher.fork()
        text = b"".join(self.grammars.token_bytes[token] or b"" for token in ending[:-1])
        return matcher.accept_string(text) and matcher.is_completed()

    def _ending(self) -> list[int] | None:
        """The closer (module doc): a valid ending from the matcher's state, as tokens ending in EOS."""
        matcher = self.matcher.fork()
        pieces: list[str | int] = []
        for _ in range(_MAX_CLOSER_PIECES):
            if matcher.is_completed():
                return self.grammars.tokens(pieces) + [self.grammars.eos_id]
            piece = matcher.find_jump_forward_string() or self._closing_piece(matcher) or self._shortest(matcher)
            if isinstance(piece, str):
                matcher.accept_string(piece)
            pieces.append(piece)
        return None

    def _closing_piece(self, matcher: xgr.GrammarMatcher) -> str | None:
        """The first closing string the matcher takes; inside free text, only one that also leaves the free text."""
        free = _takes(matcher, _FREE_TEXT_PROBE)
        for piece in _TERMINATORS if free else _CLOSERS:
            if _takes(matcher, piece) and not (free and _takes(matcher, piece + _FREE_TEXT_PROBE)):
                return piece
        return None

    def _shortest(self, matcher: xgr.GrammarMatcher) -> int:
        """The first allowed token in the grammars' fallback order, accepted."""
        matcher.fill_next_token_bitmask(self.bitmask)
        order = self.grammars.fallback_order
        allowed = self.grammars.allowed(self.bitmask)[order]
        token = int(order[int(torch.argmax(allowed.int()))])
        matcher.accept_token(token)
        return token


def _fallback_rank(piece: bytes) -> int:
    if not (piece.isascii() and piece.decode().isprintable()):
        return 2
    return 1 if piece.isspace() else 0


def _takes(matcher: xgr.GrammarMatcher, text: str) -> bool:
    """Whether the matcher accepts `text` now; its state is left as it was."""
    if not matcher.accept_string(text):
        return False
    matcher.rollback(1)
    return True
