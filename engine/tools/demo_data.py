"""`python -m engine.tools.demo_data --out DIR`: the seeded training and held-out evaluation data of the demo model
(issue 31), as chat conversations rendered to the exact prompt text the engine serves, each with the completion the
model must learn.

Seven tasks: arithmetic, short Python answers, JSON-only answers, DSML tool calls for random tool schemas,
tool-result continuations, "reply with exactly X", and retrieval of a code hidden at a given depth of filler up to a
given prompt length. Why it is built this way:

- A sample is rendered by `engine.server.chat_encoding` exactly as the server renders the same chat request (tools
  declared on the first system message; thinking with ``reasoning_effort="low"`` as the qualification gates ask, or
  chat mode as the Responses gate asks), so what is trained is what is served. The completion is the rest of the
  conversation rendered with the answer appended: reasoning, ``</think>``, content or DSML calls, and EOS. The prompt
  ends with ``<think>`` or ``</think>``, both added tokens, so prompt and completion tokenize apart as together.
- Evaluation measures generalisation: the eval split draws from its own bank (prompt templates, tool and parameter
  names, JSON keys, Python names, filler sentence grammar, needle phrasings), disjoint from the training bank. The
  answers' formats are shared, because each prompt states the format it wants.
- The qualification gates' prompts and tool are held out: `check_held_out` refuses any training sample that shares a
  run of 8 tokens with them (issue 31), taken from ``shared/reference/qualification.md`` by `held_out_texts` (engine
  code cannot import the console's gate definitions).
- Every eval sample carries what `score` needs to check an answer; tool arguments are checked against the tool's
  schema by `schema_errors`, a validator of the JSON Schema subset generated here (jsonschema is only a dev
  dependency).
- Each sample's randomness comes from its own seed (seed, split, task, index), so a sample never changes when the
  counts or the mix of the others do.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import math
import multiprocessing
import os
import random
import re
import statistics
import string
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import structlog

from engine.logging import configure_logging
from engine.server.chat_encoding import declare, encode_messages
from engine.server.dsml import parse_output
from engine.tokenizer import Tokenizer
from engine.tools.tiny_tokenizer import build_tiny_tokenizer

log = structlog.get_logger(__name__)

TASKS = ("arithmetic", "python", "json", "tool_call", "tool_result", "exact_reply", "retrieval")

# The training mix (task -> fraction of the samples). Drawn for the tokens each task gets: arithmetic is most of
# the samples but ~10 % of the tokens (a question is ~50 tokens and needs tens of thousands seen), retrieval and tool
# calls are few samples and ~2/3 of the tokens (their prompts are 0.3-4K tokens long).
DEFAULT_MIX: dict[str, float] = {
    "arithmetic": 0.50,
    "python": 0.04,
    "json": 0.08,
    "tool_call": 0.05,
    "tool_result": 0.05,
    "exact_reply": 0.18,
    "retrieval": 0.10,
}

# The trained range of each operator's operands (inclusive): held-out arithmetic is scored within it. Two-digit sums
# and differences and products up to 31 x 31: what a model of 8M parameters learns in minutes to over 90 %.
OPERAND_RANGES: dict[str, tuple[int, int]] = {"+": (0, 99), "-": (0, 99), "*": (0, 31)}

# The gates ask with reasoning_effort "low" (thinking on); the Responses gate and plain clients ask without it.
REASONING_EFFORT = "low"
THINKING_FRACTION = 0.7

DEFAULT_MAX_TOKENS = 4096
# The Tools section alone is ~500 tokens of the tiny tokenizer; below this a tool sample cannot fit.
MIN_MAX_TOKENS = 1024
# Draws of a sample before its task is taken not to fit max_tokens.
MAX_REDRAWS = 100
RETRIEVAL_MIN_TOKENS = 256
# Training haystacks start this short: the needle then often lies inside the sliding window, where the lookup and the
# copy are learnt cheaply before they must go through the c4 rows.
RETRIEVAL_TRAIN_MIN_TOKENS = 64
# Room kept after a retrieval prompt for its completion (reasoning, code, EOS).
RETRIEVAL_ANSWER_TOKENS = 64
# Room kept beside a tool sample's repeated system prompt for the request and the answer (a call is ~120 tokens).
TOOL_TURN_TOKENS = 400
# Issue 31: no training sample may share this many consecutive tokens with a held-out text.
HELD_OUT_RUN = 8

QUALIFICATION_MD = Path(__file__).resolve().parents[3] / "shared" / "reference" / "qualification.md"


# --- the banks: what each split's prompts are made of --------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """A tool parameter kind: its name, JSON Schema type and where its values come from."""

    name: str
    type: str  # string, integer, number, boolean, array (of strings)
    values: tuple[Any, ...] = ()  # strings (or enum options) to draw from
    low: float = 0
    high: float = 0


@dataclass(frozen=True)
class Filler:
    """A sentence grammar for retrieval haystacks: templates whose {slots} are filled from `words`."""

    templates: tuple[str, ...]
    words: Mapping[str, tuple[str, ...]]

    def sentence(self, rng: random.Random) -> str:
        template = rng.choice(self.templates)
        return template.format_map({slot: rng.choice(words) for slot, words in self.words.items()})


@dataclass(frozen=True)
class PythonOp:
    """A Python task: the expression over parameter {p}, and how each split describes it."""

    expr: str
    train: str
    eval: str


@dataclass(frozen=True)
class Bank:
    """Everything one split's prompts are drawn from. Train and eval banks share no template, name or word list, so
    the eval split measures what the model learned rather than what it memorised."""

    split: str
    system_lines: tuple[str, ...]
    arithmetic: tuple[str, ...]  # {a} {op} {b} {word}, the word one of OP_WORDS[op]
    python: tuple[tuple[str, str], ...]  # (template with {name} {param} {desc}, "def" or "lambda")
    python_names: Mapping[str, tuple[str, ...]]  # op -> function names
    python_params: Mapping[str, tuple[str, ...]]  # "list", "text", "words", "number" -> parameter names
    json: tuple[tuple[str, str], ...]  # (template with {fields} or {literal}, the field style)
    json_keys: Mapping[str, str]  # key -> type
    json_words: tuple[str, ...]
    field_styles: Mapping[str, str]  # style -> format of one field, {k} {v} {t}
    tool_verbs: tuple[str, ...]
    tool_nouns: tuple[str, ...]
    params: tuple[Param, ...]
    tool_requests: tuple[str, ...]  # {verb} {noun} {name} {args}
    tool_single: tuple[str, ...]  # {verb} {noun} {value}: a call whose only argument is a string
    arg_styles: tuple[tuple[str, str, bool], ...]  # (format of one argument {k} {v}, joiner, quote strings)
    result_fields: Mapping[str, tuple[Any, ...]]
    result_questions: tuple[tuple[str, str], ...]  # (template with {field} {text}, answer form)
    exact: tuple[str, ...]  # {x}
    exact_words: tuple[str, ...]
    filler: Filler
    needles: tuple[str, ...]  # {kind} {code}
    questions: tuple[str, ...]  # {kind}
    code_kinds: tuple[str, ...]
    code_words: tuple[str, ...]
    # The fraction of open-vocabulary draws (names, keys, values, words to echo, noise around a question) that are
    # made-up words instead of the lists': a model that has seen only a list recalls from it where it should copy
    # from the prompt (the first run answered "yes" to "Type PING"); made-up words leave copying the only way.
    novel: float = 0.0

    def templates(self) -> dict[str, str]:
        """Every prompt template by id: what the train/eval disjointness is about."""
        groups: dict[str, Iterable[str]] = {
            "system": self.system_lines,
            "arithmetic": self.arithmetic,
            "python": (t for t, _ in self.python),
            "python_desc": (getattr(op, self.split) for op in PYTHON_OPS.values()),
            "json": (t for t, _ in self.json),
            "json_field": self.field_styles.values(),
            "tool_call": self.tool_requests,
            "tool_single": self.tool_single,
            "tool_args": (f for f, _, _ in self.arg_styles),
            "tool_result": (t for t, _ in self.result_questions),
            "exact_reply": self.exact,
            "filler": self.filler.templates,
            "needle": self.needles,
            "question": self.questions,
        }
        return {f"{self.split}.{group}.{i}": text for group, texts in groups.items() for i, text in enumerate(texts)}


def phrasings(*slots: Sequence[str]) -> tuple[str, ...]:
    """Every sentence made of one alternative from each slot, its first letter capitalised. A training split states
    each request in hundreds of such combinations, so a held-out phrasing is a new sentence of familiar parts: trained
    on five phrasings a task, the model sent a sixth to another task's answer ("Type NACK with no other text" answered
    as arithmetic)."""
    joined = ("".join(parts) for parts in itertools.product(*slots))
    return tuple(dict.fromkeys(text[0].upper() + text[1:] for text in joined))


# What the operators are called: the language's words, not a bank's (a model cannot learn that "less" means minus
# from a prompt that never says so), so both splits share them; their sentences stay disjoint.
OP_WORDS: dict[str, tuple[str, ...]] = {
    "+": ("plus", "added to", "and", "increased by"),
    "-": ("minus", "take away", "less", "decreased by"),
    "*": ("times", "multiplied by", "by", "multiplied with"),
}

PYTHON_OPS: dict[str, PythonOp] = {
    "sum": PythonOp("sum({p})", "adds up all the numbers in {p}", "gives the total of the elements of {p}"),
    "max": PythonOp("max({p})", "finds the largest number in {p}", "yields the biggest element of {p}"),
    "min": PythonOp("min({p})", "finds the smallest number in {p}", "yields the lowest element of {p}"),
    "count_even": PythonOp(
        "sum(1 for x in {p} if x % 2 == 0)",
        "counts how many numbers in {p} are even",
        "tells how many even values {p} has",
    ),
    "squares": PythonOp(
        "[x * x for x in {p}]", "squares every number in {p}", "maps each element of {p} to its square"
    ),
    "positives": PythonOp(
        "[x for x in {p} if x > 0]", "keeps only the positive numbers of {p}", "keeps the elements of {p} above zero"
    ),
    "mean": PythonOp("sum({p}) / len({p})", "computes the average of {p}", "gives the arithmetic mean of {p}"),
    "double": PythonOp("[2 * x for x in {p}]", "doubles each number in {p}", "multiplies every element of {p} by two"),
    "length": PythonOp("len({p})", "counts the items in {p}", "tells how many elements {p} holds"),
    "reverse": PythonOp("{p}[::-1]", "reverses the string {p}", "turns the text {p} back to front"),
    "upper": PythonOp("{p}.upper()", "converts the string {p} to capital letters", "makes the text {p} uppercase"),
    "join": PythonOp('" ".join({p})', "joins the strings in {p} with single spaces", "glues the words {p} by spaces"),
    "is_even": PythonOp("{p} % 2 == 0", "checks whether the integer {p} is even", "is true when {p} divides by two"),
}
# What each op's parameter holds.
PYTHON_KINDS = {"reverse": "text", "upper": "text", "join": "words", "is_even": "number"}

TRAIN = Bank(
    split="train",
    system_lines=(
        "You are a careful assistant. Keep answers short.",
        "Answer precisely and do not add commentary.",
        "You help engineers with small tasks.",
        "Be brief; give the user exactly what they ask for.",
        "You are a support agent for an online shop.",
    ),
    arithmetic=(
        "What is {a} {op} {b}?",
        "Compute {a} {op} {b}.",
        "{a} {op} {b} = ?",
        "Calculate {a} {word} {b}.",
        "Please work out {a} {op} {b} and answer with the number.",
        "What do you get for {a} {word} {b}?",
        "Quick question: {a}{op}{b}?",
        *phrasings(
            ("", "please ", "quick one: ", "hey, "),
            ("what is ", "compute ", "calculate ", "work out ", "solve ", "what's ", "figure out "),
            ("{a} {op} {b}", "{a} {word} {b}", "{a}{op}{b}"),
            ("?", ".", ", answer with the number.", " for me.", " and give only the result."),
        ),
    ),
    python=(
        ("Write the Python function `{name}({param})`; it {desc}.", "def"),
        ("In Python, define {name} taking {param}; it {desc}.", "def"),
        ("Give me a Python def named {name} with parameter {param} that {desc}.", "def"),
        ("Python lambda `{name}` of `{param}`, which {desc}, please.", "lambda"),
        ("As a single Python lambda called {name}, taking {param}: something that {desc}.", "lambda"),
    ),
    python_names={
        "sum": ("total", "add_all", "list_sum"),
        "max": ("largest", "top_value", "peak"),
        "min": ("smallest", "low_value", "floor_of"),
        "count_even": ("count_even", "evens", "num_even"),
        "squares": ("squares", "square_all", "squared"),
        "positives": ("positives", "keep_positive", "only_positive"),
        "mean": ("mean", "average", "avg"),
        "double": ("doubled", "twice", "double_all"),
        "length": ("size", "count_items", "length_of"),
        "reverse": ("reverse", "backwards", "flip"),
        "upper": ("shout", "to_upper", "caps"),
        "join": ("join_words", "sentence", "glue"),
        "is_even": ("is_even", "even", "even_check"),
    },
    python_params={
        "list": ("xs", "values", "numbers", "items"),
        "text": ("s", "text", "word"),
        "words": ("words", "parts", "tokens"),
        "number": ("n", "value", "k"),
    },
    json=(
        ("Output one JSON dict with {fields}. Only the JSON, no other text.", "assign"),
        ("Give me JSON alone, an object where {fields}.", "is"),
        ("Respond with JSON and nothing else: {fields}.", "typed"),
        ("Send back this object as JSON and nothing more: {literal}", "literal"),
        ("I need raw JSON only. Fields: {fields}.", "colon"),
        *zip(
            phrasings(
                ("", "please "),
                ("output ", "give me ", "respond with ", "write ", "produce ", "answer with "),
                ("one JSON dict", "JSON", "a JSON dict", "an object in JSON", "a JSON record"),
                (" with {fields}", " where {fields}", " containing {fields}", " that has {fields}"),
                (". Only the JSON.", ", nothing else.", ". No other text.", ".", " and no commentary."),
            ),
            itertools.cycle(("assign", "is", "typed", "colon")),
        ),
        *(
            (t, "literal")
            for t in phrasings(
                ("output ", "give back ", "echo ", "respond with ", "write "),
                ("this object as JSON", "the object", "this JSON", "the following as JSON"),
                (": {literal}", " {literal}"),
                ("", " Nothing else.", " Only JSON.", " No other text."),
            )
        ),  # fmt: skip
    ),
    json_keys={
        **dict.fromkeys(("title", "owner", "color", "status", "city_name"), "string"),
        **dict.fromkeys(("count", "size", "year", "version"), "integer"),
        **dict.fromkeys(("enabled", "visible", "archived"), "boolean"),
        **dict.fromkeys(("price", "score", "ratio"), "number"),
    },
    json_words=("alpha", "maple", "Berlin", "green", "draft", "Nora", "river", "open", "Lisbon", "silver", "Tom"),
    field_styles={
        "assign": "{k} = {v}",
        "is": "{k} is {v}",
        "typed": "{k} ({t}) {v}",
        "colon": "{k}: {v}",
    },
    tool_verbs=("get", "list", "create", "update", "delete", "search", "count", "book", "send", "archive"),
    tool_nouns=("invoice", "order", "flight", "ticket", "user", "file", "song", "recipe", "route", "meeting", "repo"),
    params=(
        Param("origin", "string", ("Paris", "Madrid", "Vienna", "Oslo", "Prague", "Dublin")),
        Param("destination", "string", ("Rome", "Athens", "Warsaw", "Zurich", "Porto", "Riga")),
        Param("customer", "string", ("Alice Grant", "Bob Stone", "Chen Wei", "Dana Cole", "Emil Berg")),
        Param("title", "string", ("Quarterly report", "Team lunch", "Release notes", "Budget review")),
        Param("query", "string", ("red shoes", "cheap hotels", "python books", "garden tools")),
        Param("date", "string", ("2026-03-14", "2025-11-02", "2026-07-30", "2024-12-24")),
        Param("limit", "integer", low=1, high=50),
        Param("quantity", "integer", low=1, high=20),
        Param("page", "integer", low=1, high=9),
        Param("price", "number", low=0.5, high=500),
        Param("radius_km", "number", low=0.1, high=80),
        Param("urgent", "boolean"),
        Param("include_archived", "boolean"),
        Param("priority", "string", ("low", "normal", "high")),
        Param("format", "string", ("pdf", "csv", "html", "json")),
        Param("tags", "array", ("news", "sale", "blue", "draft", "vip", "eu")),
    ),
    tool_requests=(
        "Please {verb} the {noun} with {args}.",
        "Use the {name} tool: {args}.",
        "{verb} a {noun} for me. Arguments: {args}.",
        "I want to {verb} the {noun}; {args}.",
        "Can you call {name} with {args}?",
        *phrasings(
            ("", "please ", "could you "),
            ("{verb} the {noun}", "{verb} a {noun}", "call {name}", "use {name}", "run {name}"),
            (" with {args}", ": {args}", " using {args}", " where {args}"),
            (".", " for me.", " now.", "?"),
        ),
    ),
    tool_single=(
        "{verb} the {noun} for {value}, using a tool.",
        "Please {verb} the {noun} of {value} via the tool.",
        *phrasings(
            (
                "what's the {noun} in {value}?",
                "what is the {noun} for {value}?",
                "tell me the {noun} of {value}.",
                "I need the {noun} for {value}.",
                "{verb} the {noun} for {value}.",
                "how about the {noun} in {value}?",
            ),
            (" Call a tool.", " Use a tool for it.", " Please check with the tool.", " Look it up with the tool.", ""),
        ),  # fmt: skip
    ),
    arg_styles=(("{k} {v}", ", ", True), ("{k}={v}", ", ", False), ("{k}: {v}", "; ", False)),
    result_fields={
        "status": ("shipped", "pending", "delivered", "cancelled"),
        "total_eur": (12, 49, 105, 230, 999),
        "items": (1, 2, 3, 7),
        "carrier": ("DHL", "UPS", "GLS"),
        "eta_days": (1, 2, 4, 6),
        "seat": ("12A", "3C", "27F"),
        "gate_no": ("B12", "A4", "C31"),
    },
    result_questions=(
        ("What {field} did the tool report? Answer with the value only.", "value"),
        ("Give me the {field} from the result as a single value.", "value"),
        ("Tell me the {field} in one sentence.", "sentence"),
        ("Answer with the words {text}, based on the tool output.", "copy"),
        *(
            (t, "value")
            for t in phrasings(
                (
                    "what {field} did the tool return?",
                    "which {field} is in the result?",
                    "what is the {field}?",
                    "tell me the {field} from the tool.",
                    "what {field} came out?",
                ),
                (" Value only.", " Just the value.", " Answer with the value.", ""),
            )
        ),
        *(
            (t, "sentence")
            for t in phrasings(
                ("state the {field}", "describe the {field}", "tell me about the {field}"),
                (" in one sentence.", " as a sentence.", " in a short sentence."),
            )
        ),
        *(
            (t, "copy")
            for t in phrasings(
                ("answer with {text}", "write {text}", "respond {text}", "say {text}", "answer {text}"),
                (" based on the result.", " from the tool output.", " using what the tool said.", ".", " and stop."),
            )
        ),  # fmt: skip
    ),
    exact=(
        "Respond with only the word {x}.",
        "Say {x} and nothing else.",
        "Answer with {x}, nothing more.",
        "Your whole answer must be: {x}",
        "Write {x} and stop.",
        *phrasings(
            ("", "please ", "now ", "for this one, "),
            ("respond with ", "say ", "answer with ", "write ", "print ", "echo ", "send ", "reply with "),
            ("{x}", "the word {x}", "just {x}", "only {x}", "the text {x}", "precisely {x}"),
            (
                " and nothing else.",
                ", nothing more.",
                " and stop.",
                ".",
                " without anything else.",
                ", no extra words.",
                " as your whole answer.",
            ),
        ),  # fmt: skip
    ),
    exact_words=("DONE", "OK", "BLUE", "PONG", "CONFIRMED", "yes", "all clear", "42", "ACK", "green light", "HELLO"),
    filler=Filler(
        templates=(
            "The {adj} {noun} {verb} {prep} the {noun2}.",
            "{name} saw a {adj} {noun} {time}.",
            "In {place}, a {noun} {verb} {adverb}.",
            "A {noun} and a {noun2} {verb} {prep} the hill.",
            "{name} walked to {place} {time} with a {adj} {noun}.",
        ),
        words={
            "adj": ("small", "green", "old", "quiet", "bright", "tall", "warm", "wild"),
            "noun": ("tree", "river", "bird", "stone", "garden", "bridge", "cloud", "field", "boat", "lamp"),
            "noun2": ("valley", "forest", "meadow", "harbour", "path", "lake", "village", "orchard"),
            "verb": ("rests", "waits", "shines", "grows", "drifts", "sings", "turns"),
            "prep": ("near", "under", "beside", "above", "behind"),
            "name": ("Anna", "Marco", "Lena", "Omar", "Ruth", "Pavel"),
            "place": ("the town", "the market", "the mountains", "the square", "the coast"),
            "time": ("in the morning", "at noon", "last spring", "before dinner", "on Sunday"),
            "adverb": ("slowly", "softly", "often", "again", "together"),
        },
    ),
    needles=(
        "Remember this: the {kind} code is {code}.",
        "Note: the {kind} code reads {code}.",
        "Keep in mind that the {kind} code is {code}.",
        *phrasings(
            ("remember this: ", "note: ", "attention: ", "by the way, ", "secret: ", "listen: "),
            (
                "the {kind} code is {code}.",
                "the {kind} code reads {code}.",
                "the code for the {kind} is {code}.",
                "the {kind} code equals {code}.",
            ),
        ),  # fmt: skip
    ),
    questions=(
        "What is the {kind} code in the text above? Give the code only.",
        "Find the {kind} code hidden in this text and write just the code.",
        "Which {kind} code does the text mention? Output the code alone.",
        *phrasings(
            (
                "what is the {kind} code",
                "what's the {kind} code",
                "find the {kind} code",
                "look for the {kind} code",
                "recall the {kind} code",
            ),
            (" in the text above", " hidden in this text", " given earlier", " stated in the text", ""),
            ("? Give the code only.", ". Write just the code.", "? Only the code.", ".", ". Answer with the code."),
        ),  # fmt: skip
    ),
    code_kinds=("vault", "access", "door", "backup", "entry"),
    code_words=("FALCON", "MAPLE", "COBALT", "RIVER", "TIGER", "AMBER", "NOVA", "ORBIT", "CRANE", "LOTUS"),
    # Three in four: at a half, run 7 fitted training's JSON (1.0) and failed held-out keys (0.10), each bent towards
    # a list word it had learnt to recall ("weight" came out "wner" after "owner", "state" "stat" after "status").
    novel=0.75,
)

EVAL = Bank(
    split="eval",
    system_lines=(
        "You are a precise helper. Reply tersely.",
        "Stick to the request and skip explanations.",
        "You assist a data team with quick jobs.",
        "You are the assistant of a travel agency.",
    ),
    arithmetic=(
        "How much is {a} {word} {b}?",
        "Evaluate {a}{op}{b}.",
        "Give the result of {a} {op} {b}.",
        "Find {a} {op} {b}, number only.",
        "Tell me {a} {word} {b}.",
    ),
    python=(
        ("Implement {name}({param}) in Python; it {desc}.", "def"),
        ("Python please: a function called {name} with argument {param} which {desc}.", "def"),
        ("One line of Python: {name} as a lambda over {param} that {desc}.", "lambda"),
    ),
    python_names={
        "sum": ("sum_values", "grand_total"),
        "max": ("biggest", "maximum_of"),
        "min": ("lowest", "minimum_of"),
        "count_even": ("even_count", "how_many_even"),
        "squares": ("square_each", "to_squares"),
        "positives": ("filter_positive", "above_zero"),
        "mean": ("arithmetic_mean", "mean_of"),
        "double": ("times_two", "scale_by_two"),
        "length": ("element_count", "how_many"),
        "reverse": ("reversed_text", "mirror"),
        "upper": ("uppercase", "loud"),
        "join": ("space_join", "combine_words"),
        "is_even": ("even_number", "divisible_by_two"),
    },
    python_params={
        "list": ("nums", "data", "seq"),
        "text": ("line", "phrase"),
        "words": ("pieces", "terms"),
        "number": ("x", "num"),
    },
    json=(
        ("Reply only with JSON, one object having {fields}.", "equal"),
        ("Return the object {literal} as JSON, without commentary.", "literal"),
        ("JSON output only, with {fields}.", "of_type"),
    ),
    json_keys={
        **dict.fromkeys(("label", "author", "shade", "state"), "string"),
        **dict.fromkeys(("total", "weight", "release"), "integer"),
        **dict.fromkeys(("active", "hidden"), "boolean"),
        **dict.fromkeys(("cost", "rating"), "number"),
    },
    json_words=("omega", "cedar", "Tokyo", "violet", "final", "Ivan", "canyon", "closed", "Lima", "bronze"),
    field_styles={"equal": "{k} equal to {v}", "of_type": "{k} of type {t} holding {v}"},
    tool_verbs=("find", "lookup", "add", "remove", "schedule", "cancel", "rate", "check"),
    tool_nouns=("hotel", "movie", "stock", "parcel", "account", "playlist", "course", "patient", "vehicle"),
    params=(
        Param("region", "string", ("Kyoto", "Lagos", "Quito", "Hanoi", "Perth", "Cusco")),
        Param("sender", "string", ("Maya Lind", "Noah Park", "Iris Vega", "Yuki Mori")),
        Param("keyword", "string", ("solar panels", "jazz records", "rain boots", "chess sets")),
        Param("start_date", "string", ("2027-01-09", "2026-05-21", "2025-08-17")),
        Param("max_results", "integer", low=1, high=40),
        Param("nights", "integer", low=1, high=14),
        Param("budget", "number", low=10, high=900),
        Param("verbose", "boolean"),
        Param("mode", "string", ("fast", "safe", "eco")),
        Param("labels", "array", ("red", "work", "home", "later", "team")),
    ),
    tool_requests=(
        "Go ahead and {verb} the {noun}, {args}.",
        "Invoke {name} passing {args}.",
        "Time to {verb} a {noun}: {args}.",
    ),
    tool_single=("Could you {verb} the {noun} about {value} with the tool?",),
    arg_styles=(("{k} set to {v}", ", ", True), ("{v} as {k}", " and ", True)),
    result_fields={
        "room": ("Suite 4", "Room 210", "Loft 7"),
        "rate_usd": (89, 140, 310),
        "guests": (1, 2, 4),
        "stage": ("open", "closed", "waiting"),
        "duration_min": (15, 45, 90),
        "level": ("basic", "gold", "platinum"),
    },
    result_questions=(
        ("Which {field} came back? Only the value, please.", "value"),
        ("Summarise the {field} in a sentence.", "sentence"),
        ("Using the tool output, say {text}.", "copy"),
    ),
    exact=("Output {x} verbatim and stop.", "Type {x} with no other text.", "Return the text {x} alone."),
    exact_words=("FINISHED", "ROGER", "GREEN", "PING", "ACCEPTED", "no", "stand by", "17", "NACK", "SUCCESS"),
    filler=Filler(
        templates=(
            "Engineers inspected the {part} of the {machine} {when}.",
            "The {machine} in {site} ran {manner} for {hours} hours.",
            "Every {part} on the {machine} was replaced {when}.",
            "{crew} logged that the {machine} stayed {state}.",
        ),
        words={
            "part": ("valve", "gear", "pump", "rotor", "cable", "panel", "filter"),
            "machine": ("crane", "turbine", "press", "conveyor", "boiler", "generator"),
            "when": ("during the night shift", "after the storm", "on Friday", "before the audit"),
            "site": ("Dock Nine", "the east yard", "Plant Two", "the north wing"),
            "manner": ("smoothly", "loudly", "steadily", "unevenly"),
            "hours": ("three", "seven", "twelve", "forty"),
            "crew": ("The day crew", "Mechanics", "A contractor", "The foreman"),
            "state": ("idle", "cold", "stable", "offline"),
        },
    ),
    needles=("A {kind} code was issued: {code}.", "For the record, {code} is the {kind} code."),
    questions=(
        "Which {kind} code was mentioned? Answer with nothing but the code.",
        "Tell me the {kind} code from the passage, code only.",
    ),
    code_kinds=("locker", "bridge", "archive", "depot"),
    code_words=("OTTER", "CEDAR", "PRISM", "DELTA", "EMBER", "FJORD", "GLYPH", "HAVEN"),
)

BANKS = {"train": TRAIN, "eval": EVAL}

# The model's own words (what it is trained to write), shared by both splits.
REASONING = {
    "arithmetic": "The user wants {expr} computed. {work}",
    "python": "The user wants a short Python answer.",
    "json": "The user wants only JSON back.",
    "tool_call": "The {name} tool fits this request.",
    "tool_result": "The tool result holds the answer.",
    "exact_reply": "The user wants an exact reply.",
    "retrieval": "The text hides a {kind} code.",
}


# --- samples -------------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    """One conversation: the chat request (`messages`, `tools`, `reasoning_effort`), the assistant message it must
    produce (`answer`), both rendered (`prompt`, `completion`) and tokenized (`token_ids`: the prompt's, then the
    completion's), and what `score` checks (`check`)."""

    id: str
    split: str
    task: str
    template: str  # the ids of the bank templates it was made from, joined by "+"
    thinking: bool
    reasoning_effort: str | None
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    answer: dict[str, Any]
    prompt: str
    completion: str
    prompt_tokens: int
    completion_tokens: int
    check: dict[str, Any] = field(default_factory=dict)
    # Tokenized once, where the sample is drawn (a generate worker): the held-out guard and training read these.
    token_ids: list[int] = field(default_factory=list, repr=False)

    def request(self) -> dict[str, Any]:
        """The chat-completions body that makes the server render `prompt`."""
        body: dict[str, Any] = {"messages": self.messages}
        if self.tools:
            body["tools"] = self.tools
        if self.reasoning_effort:
            body["reasoning_effort"] = self.reasoning_effort
        return body


@dataclass(frozen=True)
class Built:
    """What a task builder returns, before rendering."""

    messages: list[dict[str, Any]]
    answer: dict[str, Any]
    template: str
    check: dict[str, Any]
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Config:
    seed: int = 0
    max_tokens: int = DEFAULT_MAX_TOKENS  # the longest prompt + completion
    thinking_fraction: float = THINKING_FRACTION
    operand_ranges: Mapping[str, tuple[int, int]] = field(default_factory=lambda: dict(OPERAND_RANGES))
    # The shortest retrieval prompt; None: RETRIEVAL_TRAIN_MIN_TOKENS for training, RETRIEVAL_MIN_TOKENS held out.
    retrieval_min_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < MIN_MAX_TOKENS:
            raise ValueError(f"max_tokens must be at least {MIN_MAX_TOKENS}, got {self.max_tokens}")
        least = self.retrieval_min_tokens or RETRIEVAL_MIN_TOKENS
        if not RETRIEVAL_TRAIN_MIN_TOKENS <= least <= self.max_tokens - RETRIEVAL_ANSWER_TOKENS:
            raise ValueError(f"retrieval_min_tokens {self.retrieval_min_tokens} does not fit max_tokens")


def default_tokenizer() -> Tokenizer:
    """The demo model's tokenizer: the tiny checkpoint's, with every digit a token of its own."""
    return Tokenizer(build_tiny_tokenizer(split_digits=True))


def render(messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None, thinking: bool) -> str:
    """The prompt text the server renders for this chat request."""
    mode = "thinking" if thinking else "chat"
    return encode_messages(
        declare(messages, tools or []), mode, reasoning_effort=REASONING_EFFORT if thinking else None
    )


def mix_counts(total: int, mix: Mapping[str, float] = DEFAULT_MIX) -> dict[str, int]:
    """`total` split by the mix's fractions (largest remainders), every task with a fraction getting at least one."""
    unknown = set(mix) - set(TASKS)
    if unknown:
        raise ValueError(f"unknown tasks in the mix: {sorted(unknown)}; expected some of {TASKS}")
    weights = {task: fraction for task, fraction in mix.items() if fraction > 0}
    if total < len(weights):
        raise ValueError(f"{total} samples cannot cover the {len(weights)} tasks of the mix")
    scale = sum(weights.values())
    exact = {task: total * fraction / scale for task, fraction in weights.items()}
    counts = {task: max(1, int(value)) for task, value in exact.items()}
    by_remainder = sorted(weights, key=lambda task: exact[task] - int(exact[task]), reverse=True)
    for task in by_remainder[: total - sum(counts.values())]:
        counts[task] += 1
    while sum(counts.values()) > total:  # the minimum of one took more than the remainders left
        counts[max(counts, key=counts.get)] -= 1
    return counts


def generate(
    split: str, counts: Mapping[str, int], config: Config | None = None, tokenizer: Tokenizer | None = None
) -> list[Sample]:
    """`counts[task]` samples of each task for `split` ("train" or "eval"), the training split shuffled."""
    config = config or Config()
    tokenizer = tokenizer or default_tokenizer()
    jobs = [(task, index) for task, count in counts.items() for index in range(count)]
    # Drawing a sample is mostly Python (a retrieval haystack tokenizes sentence by sentence), which threads do not
    # scale: 120,000 samples took 160 s of a 10-minute device call in 16 threads. Forked workers inherit the tokenizer.
    workers = min(len(jobs) // 256 + 1, os.cpu_count() or 1)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(workers, context, initializer=_drawing, initargs=(split, config, tokenizer)) as pool:
        samples = list(pool.map(_drawn, jobs, chunksize=max(1, len(jobs) // (8 * workers))))
    if split == "train":
        random.Random(f"{config.seed}/{split}/order").shuffle(samples)
    return samples


_DRAWING: tuple[str, Config, Tokenizer] | None = None  # a generate worker's split, config and tokenizer


def _drawing(split: str, config: Config, tokenizer: Tokenizer) -> None:
    global _DRAWING
    _DRAWING = split, config, tokenizer


def _drawn(job: tuple[str, int]) -> Sample:
    """The job's sample, from its own seed."""
    assert _DRAWING is not None, "a generate worker draws after _drawing"
    (split, config, tokenizer), (task, index) = _DRAWING, job
    rng = random.Random(f"{config.seed}/{split}/{task}/{index}")
    return _sample(f"{split}-{task}-{index:05d}", task, rng, BANKS[split], config, tokenizer)


def _sample(sample_id: str, task: str, rng: random.Random, bank: Bank, config: Config, tokenizer: Tokenizer) -> Sample:
    """The sample drawn from `rng`; one over max_tokens (a tool sample offers up to three tools of made-up names: up
    to ~3,900 tokens) is drawn again, from where the rng has come to."""
    for _ in range(MAX_REDRAWS):
        thinking = rng.random() < config.thinking_fraction
        built = BUILDERS[task](_Draw(rng, bank, config, tokenizer, thinking))
        answer = built.answer
        prompt = render(built.messages, built.tools, thinking)
        full = render([*built.messages, answer], built.tools, thinking)
        if not full.startswith(prompt):
            raise AssertionError(f"{sample_id}: the conversation with its answer does not extend the prompt")
        completion = full[len(prompt) :]
        prompt_ids, completion_ids = tokenizer.encode(prompt), tokenizer.encode(completion)
        if len(prompt_ids) + len(completion_ids) <= config.max_tokens:
            break
    else:
        raise ValueError(f"{sample_id}: no {task} sample within max_tokens={config.max_tokens} in {MAX_REDRAWS} draws")
    return Sample(
        id=sample_id,
        split=bank.split,
        task=task,
        template=built.template,
        thinking=thinking,
        reasoning_effort=REASONING_EFFORT if thinking else None,
        messages=built.messages,
        tools=built.tools,
        answer=answer,
        prompt=prompt,
        completion=completion,
        prompt_tokens=len(prompt_ids),
        completion_tokens=len(completion_ids),
        check=built.check,
        token_ids=prompt_ids + completion_ids,
    )


_ONSETS = ("b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "gr", "pl",
           "st", "tr", "sh", "ch")  # fmt: skip
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ou")


def novel_word(rng: random.Random, shape: str = "word") -> str:
    """A made-up word in one of the shapes a slot takes: "name" (an identifier, maybe two words joined by _), "value"
    (lower, capitalised or two words), "exact" (any case, maybe with digits), "code" (upper). A word is 1-3
    syllables, or in a third of draws 2-8 random letters: held-out names follow neither the syllables' letter
    patterns nor any list's, so only a copy that follows whatever letters the prompt has gets them right."""

    def one() -> str:
        if rng.random() < 1 / 3:
            return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8)))
        word = "".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        return word + (rng.choice("nrstlkm") if rng.random() < 0.5 else "")

    roll = rng.random()
    if shape == "name":
        return f"{one()}_{one()}" if roll < 0.4 else one()
    if shape == "code":
        return one().upper()
    if shape == "value":
        return one().capitalize() if roll < 0.4 else f"{one()} {one()}" if roll < 0.6 else one()
    if roll < 0.35:
        return one().upper()
    if roll < 0.55:
        return one().capitalize()
    if roll < 0.7:
        return f"{one().upper()}{rng.randint(1, 99)}"
    return f"{one()} {one()}" if roll < 0.8 else one()


@dataclass
class _Draw:
    """A sample's random source and the bank it draws from."""

    rng: random.Random
    bank: Bank
    config: Config
    tokenizer: Tokenizer
    thinking: bool

    def template(self, group: str, templates: Sequence[Any]) -> tuple[str, Any]:
        """A random template and its id."""
        index = self.rng.randrange(len(templates))
        return f"{self.bank.split}.{group}.{index}", templates[index]

    def word(self, pool: Sequence[str], shape: str = "word") -> str:
        """One of `pool`, or, in the bank's `novel` fraction of draws, a made-up word of that shape."""
        return novel_word(self.rng, shape) if self.rng.random() < self.bank.novel else self.rng.choice(pool)

    def distinct(self, pool: Sequence[str], k: int, shape: str = "word") -> list[str]:
        """k different words, each as `word` draws them."""
        chosen: list[str] = []
        while len(chosen) < k:
            if (w := self.word(pool, shape)) not in chosen:
                chosen.append(w)
        return chosen

    def noisy(self, text: str) -> str:
        """The text, or (in half the bank's `novel` fraction) with 1-3 made-up words before or after it."""
        if self.rng.random() >= self.bank.novel / 2:
            return text
        noise = " ".join(novel_word(self.rng, "value") for _ in range(self.rng.randint(1, 3)))
        return f"{noise}: {text}" if self.rng.random() < 0.5 else f"{text} ({noise})"

    def system(self) -> tuple[list[dict[str, Any]], list[str]]:
        """No system message, or a short one (its template id listed)."""
        if self.rng.random() < 0.6:
            return [], []
        tid, line = self.template("system", self.bank.system_lines)
        return [{"role": "system", "content": line}], [tid]


def _user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def _reply(draw: _Draw, task: str, content: str, **values: Any) -> dict[str, Any]:
    """The assistant's message; in thinking mode with its reasoning (chat mode renders none)."""
    message = {"role": "assistant", "content": content}
    if draw.thinking:
        message["reasoning_content"] = REASONING[task].format(**values)
    return message


def arithmetic_work(a: int, op: str, b: int) -> str:
    """The reasoning's working, a step a small model can take at a time: a sum or difference by the tens then the
    ones of `b` (47 + 38 = 47 + 30 + 8 = 77 + 8 = 85), a negative difference as the positive one negated, a product by
    `b`'s tens and ones (23 * 17 = 23 * 10 + 23 * 7 = 230 + 161 = 391). Answered in one step, the model of run 7
    erred by a digit in a third of them, mostly in differences."""
    if op == "-" and a < b:
        return f"{a} - {b} = -({b} - {a}). {arithmetic_work(b, op, a)} So {a} - {b} = {a - b}."
    tens, ones = b - b % 10, b % 10
    if op == "*":
        if not tens or not ones:
            return f"{a} * {b} = {a * b}."
        return f"{a} * {b} = {a} * {tens} + {a} * {ones} = {a * tens} + {a * ones} = {a * b}."
    step = (lambda x, y: x + y) if op == "+" else (lambda x, y: x - y)
    if not tens or not ones:
        return f"{a} {op} {b} = {step(a, b)}."
    return f"{a} {op} {b} = {a} {op} {tens} {op} {ones} = {step(a, tens)} {op} {ones} = {step(a, b)}."


def _arithmetic(draw: _Draw) -> Built:
    rng, bank = draw.rng, draw.bank
    op = rng.choice(sorted(draw.config.operand_ranges))
    low, high = draw.config.operand_ranges[op]
    a, b = rng.randint(low, high), rng.randint(low, high)
    result = a + b if op == "+" else a - b if op == "-" else a * b
    tid, template = draw.template("arithmetic", bank.arithmetic)
    system, ids = draw.system()
    question = draw.noisy(template.format(a=a, op=op, b=b, word=rng.choice(OP_WORDS[op])))
    return Built(
        messages=[*system, _user(question)],
        answer=_reply(draw, "arithmetic", str(result), expr=f"{a} {op} {b}", work=arithmetic_work(a, op, b)),
        template="+".join([*ids, tid]),
        check={"expected": str(result), "a": a, "op": op, "b": b},
    )


def _python(draw: _Draw) -> Built:
    rng, bank = draw.rng, draw.bank
    op_name = rng.choice(sorted(PYTHON_OPS))
    op = PYTHON_OPS[op_name]
    name = draw.word(bank.python_names[op_name], "name")
    param = draw.word(bank.python_params[PYTHON_KINDS.get(op_name, "list")], "name")
    tid, (template, form) = draw.template("python", bank.python)
    desc = getattr(op, bank.split).format(p=param)
    expr = op.expr.format(p=param)
    code = f"def {name}({param}):\n    return {expr}" if form == "def" else f"{name} = lambda {param}: {expr}"
    system, ids = draw.system()
    return Built(
        messages=[*system, _user(template.format(name=name, param=param, desc=desc))],
        answer=_reply(draw, "python", f"```python\n{code}\n```"),
        template="+".join([*ids, tid, f"{bank.split}.python_desc.{list(PYTHON_OPS).index(op_name)}"]),
        check={"code": code, "name": name, "op": op_name},
    )


def _json_value(rng: random.Random, kind: str, word: Callable[[], str]) -> Any:
    if kind == "string":
        return word()
    if kind == "integer":
        return rng.randint(0, 500)
    if kind == "number":
        return round(rng.uniform(0, 100), rng.choice((1, 2)))
    return rng.random() < 0.5


def _json(draw: _Draw) -> Built:
    rng, bank = draw.rng, draw.bank
    kinds = sorted(set(bank.json_keys.values()))
    keys = draw.distinct(sorted(bank.json_keys), rng.randint(2, 4), "name")
    types = {key: bank.json_keys.get(key) or rng.choice(kinds) for key in keys}
    obj = {key: _json_value(rng, types[key], lambda: draw.word(bank.json_words, "value")) for key in keys}
    tid, (template, style) = draw.template("json", bank.json)
    ids = [tid]
    if style == "literal":
        question = template.format(literal=json.dumps(obj, separators=(",", ":")))
    else:
        ids.append(f"{bank.split}.json_field.{list(bank.field_styles).index(style)}")
        pieces = [
            bank.field_styles[style].format(k=key, v=json.dumps(value), t=types[key]) for key, value in obj.items()
        ]
        question = template.format(fields=", ".join(pieces))
    system, system_ids = draw.system()
    return Built(
        messages=[*system, _user(question)],
        answer=_reply(draw, "json", json.dumps(obj)),
        template="+".join([*system_ids, *ids]),
        check={"types": types, "expected": obj},
    )


def _param_value(rng: random.Random, param: Param) -> Any:
    if param.type == "string":
        return rng.choice(param.values)
    if param.type == "integer":
        return rng.randint(int(param.low), int(param.high))
    if param.type == "number":
        return round(rng.uniform(param.low, param.high), 1)
    if param.type == "boolean":
        return rng.random() < 0.5
    return rng.sample(param.values, rng.randint(1, 3))


def _param_schema(rng: random.Random, param: Param) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": param.type}
    if param.type == "array":
        schema["items"] = {"type": "string"}
    elif param.type == "integer" and rng.random() < 0.5:
        schema |= {"minimum": int(param.low), "maximum": int(param.high)}
    elif param.type == "string" and len(param.values) <= 4:
        schema["enum"] = list(param.values)  # short value lists are enums
    if rng.random() < 0.5:
        schema["description"] = f"The {param.name.replace('_', ' ')}."
    return schema


def _novel_param(rng: random.Random) -> Param:
    """A parameter of a made-up name, type and values (see Bank.novel)."""
    name, kind = novel_word(rng, "name"), rng.choice(("string", "string", "integer", "number", "boolean", "array"))
    if kind in ("string", "array"):
        return Param(name, kind, tuple(dict.fromkeys(novel_word(rng, "value") for _ in range(rng.randint(3, 6)))))
    low = rng.randint(0, 20)
    return Param(name, kind, low=low, high=low + rng.randint(5, 200))


def _params(draw: _Draw) -> list[Param]:
    """1-4 parameters of distinct names: the bank's, or (Bank.novel) made-up ones."""
    chosen: dict[str, Param] = {}
    for _ in range(draw.rng.randint(1, 4)):
        param = _novel_param(draw.rng) if draw.rng.random() < draw.bank.novel else draw.rng.choice(draw.bank.params)
        chosen.setdefault(param.name, param)
    return list(chosen.values())


def _tool(draw: _Draw, verb: str, noun: str) -> tuple[dict[str, Any], list[Param]]:
    """A random tool and its parameters: 1-4, some required; half the schemas close their properties."""
    rng, params = draw.rng, _params(draw)
    required = [p.name for p in params if rng.random() < 0.6] or [params[0].name]
    parameters: dict[str, Any] = {
        "type": "object",
        "properties": {p.name: _param_schema(rng, p) for p in params},
        "required": required,
    }
    if rng.random() < 0.5:
        parameters["additionalProperties"] = False
    function = {"name": f"{verb}_{noun}", "description": f"{verb.capitalize()} a {noun}.", "parameters": parameters}
    return {"type": "function", "function": function}, params


def _shown(value: Any, quote: bool) -> str:
    """An argument's value as a request states it: strings as they are (or quoted), the rest as JSON."""
    if isinstance(value, str):
        return f'"{value}"' if quote else value
    return json.dumps(value)


def _call_message(draw: _Draw, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    """The assistant's turn calling `name` with `arguments` (a JSON string, as clients send it back)."""
    call = {
        "id": _call_id(draw.rng),
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(arguments)},
    }
    return _reply(draw, "tool_call", "", name=name) | {"tool_calls": [call]}


def _tool_call_setup(draw: _Draw) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any], str, list[str]]:
    """Offered tools, the chosen one, its arguments, the user's request and the template ids."""
    rng, bank = draw.rng, draw.bank
    verb = draw.word(bank.tool_verbs, "name")
    nouns = draw.distinct(bank.tool_nouns, rng.randint(1, 3), "name")
    made = [_tool(draw, draw.word(bank.tool_verbs, "name") if i else verb, noun) for i, noun in enumerate(nouns)]
    chosen, chosen_params = made[0]
    tools = [tool for tool, _ in made]
    rng.shuffle(tools)
    schema = chosen["function"]["parameters"]
    by_name = {p.name: p for p in chosen_params}
    names = [n for n in schema["properties"] if n in schema["required"] or rng.random() < 0.5]
    arguments = {n: _param_value(rng, by_name[n]) for n in names}
    values = {"verb": verb, "noun": nouns[0], "name": chosen["function"]["name"]}
    if len(arguments) == 1 and isinstance(next(iter(arguments.values())), str) and rng.random() < 0.5:
        tid, template = draw.template("tool_single", bank.tool_single)
        request, ids = template.format(value=next(iter(arguments.values())), **values), [tid]
    else:
        tid, template = draw.template("tool_call", bank.tool_requests)
        aid, (pair, joiner, quote) = draw.template("tool_args", bank.arg_styles)
        shown = [pair.format(k=k, v=_shown(v, quote)) for k, v in arguments.items()]
        request, ids = template.format(args=joiner.join(shown) or "no arguments", **values), [tid, aid]
    request = request[0].upper() + request[1:]
    return tools, chosen, arguments, request, ids


def _tool_system(draw: _Draw, tools: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """None, one line, or one line repeated as the gates' shared-prefix system prompt is, within the token budget."""
    rng = draw.rng
    shape = rng.random()
    if shape < 0.3:
        return [], []
    tid, line = draw.template("system", draw.bank.system_lines)
    repeats = 1
    if shape > 0.7:
        encode = draw.tokenizer.encode
        fixed = len(encode(render([_user("x")], tools, draw.thinking))) + TOOL_TURN_TOKENS
        per_line = len(encode(f"{line}\n{line}")) - len(encode(line))
        most = (draw.config.max_tokens - fixed) // per_line
        repeats = rng.randint(2, most) if most >= 2 else 1
    return [{"role": "system", "content": "\n".join([line] * repeats)}], [tid]


def _call_id(rng: random.Random) -> str:
    return "call_" + "".join(rng.choices("0123456789abcdef", k=24))


def _tool_call(draw: _Draw) -> Built:
    tools, chosen, arguments, request, ids = _tool_call_setup(draw)
    system, system_ids = _tool_system(draw, tools)
    name = chosen["function"]["name"]
    return Built(
        messages=[*system, _user(request)],
        answer=_call_message(draw, name, arguments),
        template="+".join([*system_ids, *ids]),
        check={"name": name, "parameters": chosen["function"]["parameters"], "arguments": arguments},
        tools=tools,
    )


def _tool_result(draw: _Draw) -> Built:
    """A call already made and its result given; the answer uses the result. The tools stay declared or, as in the
    gate's second turn, are dropped."""
    rng, bank = draw.rng, draw.bank
    tools, chosen, arguments, request, ids = _tool_call_setup(draw)
    call = _call_message(draw, chosen["function"]["name"], arguments)
    fields = draw.distinct(sorted(bank.result_fields), rng.randint(2, 4), "name")
    result = {f: rng.choice(bank.result_fields[f]) if f in bank.result_fields
              else rng.choice((novel_word(rng, "value"), rng.randint(1, 999))) for f in fields}  # fmt: skip
    asked = fields[0]
    tid, (template, form) = draw.template("tool_result", bank.result_questions)
    value = str(result[asked])
    if form == "copy":
        text = f"{str(result[fields[0]]).upper()} {result[fields[1]]}"
        question, content, expected = template.format(text=text), text, [text]
    elif form == "sentence":
        question, content, expected = template.format(field=asked), f"The {asked} is {value}.", [value]
    else:
        question, content, expected = template.format(field=asked), value, [value]
    messages = [
        _user(request),
        call,
        {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": json.dumps(result)},
        _user(question),
    ]
    keep_tools = rng.random() < 0.5
    return Built(
        messages=messages,
        answer=_reply(draw, "tool_result", content),
        template="+".join([*ids, tid]),
        check={"expected": expected},
        tools=tools if keep_tools else None,
    )


def _exact_reply(draw: _Draw) -> Built:
    """Training's made-up draws are phrases of 1-6 made-up words and codes, so every answer token is a copy from the
    prompt: copying is what run 6 lacked, and a one-word reply gives few tokens to learn it from."""
    rng = draw.rng
    if draw.bank.novel and rng.random() < draw.bank.novel:
        x = " ".join(
            _code(rng, [novel_word(rng, "code"), novel_word(rng, "code")])
            if rng.random() < 0.25
            else novel_word(rng, rng.choice(("exact", "value")))
            for _ in range(rng.randint(1, 6))
        )
    else:
        x = draw.word(draw.bank.exact_words, "exact")
    tid, template = draw.template("exact_reply", draw.bank.exact)
    system, ids = draw.system()
    return Built(
        messages=[*system, _user(template.format(x=x))],
        answer=_reply(draw, "exact_reply", x),
        template="+".join([*ids, tid]),
        check={"expected": x},
    )


def _code(rng: random.Random, words: Sequence[str]) -> str:
    """A secret in one of a few shapes, the gate's WORD-NNNNN-WORD among them."""
    digits = lambda n: "".join(rng.choices(string.digits, k=n))
    shape = rng.randrange(4)
    if shape == 0:
        first, last = rng.sample(words, 2)
        return f"{first}-{digits(5)}-{last}"
    if shape == 1:
        return f"{digits(4)}-{digits(4)}"
    if shape == 2:
        return f"{rng.choice(words)}-{digits(3)}"
    return "".join(rng.choices(string.ascii_uppercase + string.digits, k=rng.randint(6, 8)))


def _retrieval(draw: _Draw) -> Built:
    """Filler of the split's grammar (or one of its sentences repeated, as the gate's haystack is) around a needle at
    `depth` of the filler's tokens, then the question; the prompt is `target_tokens` long."""
    rng, bank, tokenizer = draw.rng, draw.bank, draw.tokenizer
    kind = draw.word(bank.code_kinds, "name").replace("_", " ")
    code = _code(rng, [draw.word(bank.code_words, "code") for _ in range(2)] if bank.novel else bank.code_words)
    nid, needle = draw.template("needle", bank.needles)
    qid, question = draw.template("question", bank.questions)
    needle, question = needle.format(kind=kind, code=code), question.format(kind=kind)
    train = bank.split == "train"
    low = draw.config.retrieval_min_tokens or (RETRIEVAL_TRAIN_MIN_TOKENS if train else RETRIEVAL_MIN_TOKENS)
    high = draw.config.max_tokens - RETRIEVAL_ANSWER_TOKENS
    # Training lengths are log-uniform (a short haystack teaches the lookup for a fraction of a long one's tokens);
    # held-out lengths are uniform, so every part of the context is scored alike.
    target = round(math.exp(rng.uniform(math.log(low), math.log(high)))) if train else rng.randint(low, high)
    depth = round(rng.random(), 3)

    base = len(tokenizer.encode(render([_user(f"{needle}\n\n{question}")], None, draw.thinking)))
    repeated = bank.filler.sentence(rng) if rng.random() < 0.3 else None
    sentences: list[str] = []
    counts: list[int] = []
    total = 0
    # Joined by spaces, the filler's tokens are the sum of its sentences' own (the pre-tokenizer splits at spaces).
    while base + total < target:
        sentence = repeated or bank.filler.sentence(rng)
        sentences.append(sentence)
        counts.append(len(tokenizer.encode(" " + sentence)))
        total += counts[-1]
    before, reached = 0, 0
    while before < len(counts) and reached < depth * total:
        reached += counts[before]
        before += 1
    filler = [*sentences[:before], needle, *sentences[before:]]
    messages = [_user(" ".join(filler) + "\n\n" + question)]
    return Built(
        messages=messages,
        answer=_reply(draw, "retrieval", code, kind=kind),
        template="+".join([nid, qid, *(f"{bank.split}.filler.{i}" for i in range(len(bank.filler.templates)))]),
        check={"expected": code, "kind": kind, "needle": needle, "depth": depth, "target_tokens": target},
    )


def needle_distance(sample: Sample, tokenizer: Tokenizer) -> int:
    """The prompt tokens from a retrieval sample's needle sentence to the prompt's end. One within the sliding window
    is read by every layer's window; one beyond it only through the c4 and c128 rows (and the indexer's top-k)."""
    head = sample.prompt[: sample.prompt.index(sample.check["needle"])]
    # The pre-tokenizer splits before a space: the filler's space before the needle is the needle's first token's.
    return sample.prompt_tokens - len(tokenizer.encode(head.removesuffix(" ")))


BUILDERS: dict[str, Callable[[_Draw], Built]] = {
    "arithmetic": _arithmetic,
    "python": _python,
    "json": _json,
    "tool_call": _tool_call,
    "tool_result": _tool_result,
    "exact_reply": _exact_reply,
    "retrieval": _retrieval,
}


# --- checking answers ----------------------------------------------------------------------------------------------


# JSON Schema's types of a decoded JSON value (a bool is not a number; 2.0 is an integer).
_IS_TYPE: dict[str, Callable[[Any], bool]] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    "integer": lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer()),
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
}


def schema_errors(value: Any, schema: Mapping[str, Any], where: str = "arguments") -> list[str]:
    """Why `value` fails `schema`: the JSON Schema subset the tools here use (type, properties, required,
    additionalProperties false, items, enum, minimum, maximum); an empty list when it is valid."""
    kind = schema.get("type")
    if kind is not None and not _IS_TYPE[kind](value):
        return [f"{where}: expected {kind}, got {type(value).__name__}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: {value} is below {schema['minimum']}")
    if "maximum" in schema and value > schema["maximum"]:
        errors.append(f"{where}: {value} is above {schema['maximum']}")
    if kind == "array" and "items" in schema:
        for i, item in enumerate(value):
            errors += schema_errors(item, schema["items"], f"{where}[{i}]")
    if kind == "object":
        properties = schema.get("properties", {})
        errors += [f"{where}: missing required {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                errors += schema_errors(item, properties[key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: unexpected {key!r}")
    return errors


def _fenced_code(content: str) -> str:
    """The code of a ```python fence, or the whole answer when it has none."""
    text = content.strip()
    if text.startswith("```"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
        text = text.rsplit("```", 1)[0]
    return text


def _same_code(answer: str, reference: str) -> bool:
    """The same program, whatever its layout (compared as syntax trees)."""
    try:
        return ast.dump(ast.parse(answer)) == ast.dump(ast.parse(reference))
    except SyntaxError:
        return False


def _json_ok(content: str, types: Mapping[str, str]) -> bool:
    """Only a JSON object, with exactly the asked keys, each of its asked type."""
    try:
        value = json.loads(content.strip())
    except ValueError:
        return False
    properties = {key: {"type": kind} for key, kind in types.items()}
    schema = {"type": "object", "properties": properties, "required": list(types), "additionalProperties": False}
    return not schema_errors(value, schema)


def _folded(text: str) -> str:
    return text.casefold().replace(" ", "")


def score(task: str, sample: Sample | Mapping[str, Any], completion_text: str) -> bool:
    """Whether `completion_text` (what the model wrote after the prompt: reasoning, ``</think>`` and the answer, EOS
    optional) answers `sample` (a Sample or its JSONL record). Arithmetic, exact replies and retrieval: the answer is
    exactly the expected text; Python: the same code; JSON: only an object with the asked keys and types; tool
    calls: the first call parses (dsml), names the intended tool and has schema-valid arguments; tool results: the
    answer, case-folded without spaces, holds each expected piece (the gate's rule)."""
    record = asdict(sample) if isinstance(sample, Sample) else sample
    check = record["check"]
    parsed = parse_output(completion_text, tools_offered=bool(record["tools"]), thinking=record["thinking"])
    content = parsed.content.strip()
    if task == "tool_call":
        if not parsed.tool_calls or parsed.tool_calls[0].name != check["name"]:
            return False
        return not schema_errors(json.loads(parsed.tool_calls[0].arguments), check["parameters"])
    if task == "python":
        return _same_code(_fenced_code(content), check["code"])
    if task == "json":
        return _json_ok(content, check["types"])
    if task == "tool_result":
        return all(_folded(piece) in _folded(content) for piece in check["expected"])
    if task in ("arithmetic", "exact_reply", "retrieval"):
        return content == check["expected"]
    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


# --- the held-out guard --------------------------------------------------------------------------------------------


class HeldOutLeak(ValueError):
    """A training sample shares a run of tokens with a held-out text: which sample, the run (decoded) and the text."""

    def __init__(self, sample: Sample, run: str, text: str) -> None:
        super().__init__(f"{sample.id} ({sample.task}) shares the run {run!r} with the held-out text {text!r}")
        self.sample_id, self.run, self.text = sample.id, run, text


def held_out_texts(path: Path = QUALIFICATION_MD) -> list[str]:
    """The quoted texts of the qualification gates (§2 of qualification.md): every "double-quoted" and `code` span
    on a line, and the double-quoted strings inside those, e.g. the prompt inside a request body."""
    section = re.search(r"^## 2\..*?(?=^## 3\.)", Path(path).read_text(encoding="utf-8"), re.MULTILINE | re.DOTALL)
    if section is None:
        raise ValueError(f"{path}: no '## 2.' section (the qualification gates) before '## 3.'")
    texts: list[str] = []
    for line in section[0].splitlines():
        texts += _quoted(line)
    texts += [inner for span in texts for inner in _quoted(span, '"')]
    return list(dict.fromkeys(texts))


def _quoted(line: str, quotes: str = '`"') -> list[str]:
    """Spans between matching quotes, read left to right (a quote inside a span belongs to the span)."""
    spans, i = [], 0
    while i < len(line):
        if line[i] in quotes:
            close = line.find(line[i], i + 1)
            if close < 0:
                break
            spans.append(line[i + 1 : close])
            i = close + 1
        else:
            i += 1
    return spans


def held_out_runs(texts: Iterable[str], tokenizer: Tokenizer, n: int = HELD_OUT_RUN) -> dict[tuple[int, ...], str]:
    """Every n-token run of the texts, mapped to its text. Each text is tokenized alone and after a space, as it
    would be inside a sentence: a byte-level tokenizer writes a word's leading space into its first token."""
    runs: dict[tuple[int, ...], str] = {}
    for text in texts:
        for variant in (text, " " + text):
            ids = tokenizer.encode(variant)
            runs.update((run, text) for run in zip(*(ids[k:] for k in range(n)), strict=False))
    return runs


def _leaks(samples: Sequence[Sample], runs: Mapping[tuple[int, ...], str], n: int):
    """(sample, the first run it shares with a held-out text) for each sample that shares one, in order: of the
    tokens trained on, the sample's `token_ids`."""
    for sample in samples:
        ids = sample.token_ids
        windows = zip(*(ids[k:] for k in range(n)), strict=False)
        if runs.keys().isdisjoint(windows):  # a set operation in C: the common case stays fast
            continue
        yield sample, next(w for w in zip(*(ids[k:] for k in range(n)), strict=False) if w in runs)


def check_held_out(samples: Iterable[Sample], texts: Iterable[str], tokenizer: Tokenizer, n: int = HELD_OUT_RUN) -> int:
    """Raise HeldOutLeak for the first sample whose prompt and completion share an n-token run with a held-out text;
    return the number of runs checked against."""
    runs = held_out_runs(texts, tokenizer, n)
    for sample, run in _leaks(list(samples), runs, n):
        raise HeldOutLeak(sample, tokenizer.decode(run, False), runs[run])
    return len(runs)


def without_held_out(samples: Iterable[Sample], texts: Iterable[str], tokenizer: Tokenizer,
                     n: int = HELD_OUT_RUN) -> list[Sample]:  # fmt: skip
    """The samples that share no n-token run with a held-out text. Made-up words can, rarely, spell one (seed 356
    drew a needle whose code began "ZEB": " code is ZEB" is a run of the gate's needle): training leaves those out
    rather than stop."""
    samples = list(samples)
    runs = held_out_runs(texts, tokenizer, n)
    leaking = {id(sample) for sample, _ in _leaks(samples, runs, n)}
    if leaking:
        log.info("held_out_samples_dropped", count=len(leaking), of=len(samples))
    return [sample for sample in samples if id(sample) not in leaking]


# --- the command line ----------------------------------------------------------------------------------------------


def write_jsonl(path: Path, samples: Iterable[Sample]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for sample in samples:
            record = {k: v for k, v in asdict(sample).items() if k != "token_ids"}  # the text says what they are
            out.write(json.dumps(record, ensure_ascii=False) + "\n")


def summary(samples: Sequence[Sample]) -> str:
    """One line per task: samples, prompt tokens (mean / max) and completion tokens (mean)."""
    lines = [f"{'task':<12} {'samples':>7} {'prompt mean':>11} {'prompt max':>10} {'completion mean':>15}"]
    for task in TASKS:
        group = [s for s in samples if s.task == task]
        if group:
            prompts = [s.prompt_tokens for s in group]
            completions = statistics.mean(s.completion_tokens for s in group)
            lines.append(
                f"{task:<12} {len(group):>7} {statistics.mean(prompts):>11.0f} {max(prompts):>10} {completions:>15.1f}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for train.jsonl and eval.jsonl")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--train", type=int, default=20_000, help="training samples, split by the default mix")
    parser.add_argument("--eval", type=int, default=50, help="evaluation samples per task")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="longest prompt + completion")
    parser.add_argument("--held-out", type=Path, default=QUALIFICATION_MD, help="the gates' qualification.md")
    parser.add_argument("--tokenizer", type=Path, help="a model directory's tokenizer (default: the tiny one)")
    args = parser.parse_args(argv)
    if not args.held_out.is_file():
        parser.error(f"the held-out gate texts are not at {args.held_out}; pass --held-out PATH to qualification.md")
    configure_logging()
    tokenizer = Tokenizer.from_model_dir(args.tokenizer) if args.tokenizer else default_tokenizer()
    config = Config(seed=args.seed, max_tokens=args.max_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    splits = {"train": mix_counts(args.train), "eval": dict.fromkeys(TASKS, args.eval)}
    for split, counts in splits.items():
        started = time.perf_counter()
        samples = generate(split, counts, config, tokenizer)
        if split == "train":
            texts = held_out_texts(args.held_out)
            runs = check_held_out(samples, texts, tokenizer)
            log.info("held_out_guard", texts=len(texts), runs=runs, samples=len(samples), passed=True)
        write_jsonl(args.out / f"{split}.jsonl", samples)
        seconds = round(time.perf_counter() - started, 2)
        log.info("demo_data_written", split=split, samples=len(samples), seed=args.seed, seconds=seconds)
        print(f"{split}: {len(samples)} samples -> {args.out / f'{split}.jsonl'}\n{summary(samples)}\n")


if __name__ == "__main__":
    main()
