"""One request as the engine tracks it: tokens so far, how far the model has processed them, its model state and
the KV pages it holds.

A sampled token is counted from the step that samples it: while that step is still on the device (the engine runs
the next step before reading it, see llm_engine.py) it is `num_in_flight`, part of `num_tokens` but not yet in
`output_ids`; the next step reads it from the device."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.cache.block_manager import PageTable
from engine.model.state import SequenceState
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStrings
from engine.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


def output_budget(prompt_len: int, max_tokens: int, max_request_tokens: int) -> int:
    """The most tokens a request may generate: `max_tokens`, within the room that the longest request (the context,
    or the KV pool when smaller) leaves after its prompt. The engine sets it once, when a request is added; the server
    clamps a request's budget by the same rule, and the sampler's grammar counts down from it."""
    return min(max_tokens, max_request_tokens - prompt_len)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float]


@dataclass
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    request_id: str = field(default_factory=lambda: f"req-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    text: str = ""
    num_text_sent: int = 0  # characters of `text` already handed out as deltas
    status: Status = Status.WAITING
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    num_computed: int = 0  # tokens the model has processed
    state: SequenceState | None = None
    replica: int = 0  # the data-parallel rank whose scheduler, pool and device run it (0 unless there are several)
    # What the scheduler's block manager gave it while it runs: a request slot, and the pages of its tokens.
    slot: int | None = None
    page_table: PageTable = field(default_factory=PageTable)
    generator: torch.Generator | None = None
    num_in_flight: int = 0  # sampled tokens still on the device, not yet in `output_ids`
    # Prefix caching: prompt tokens its first admission took from cached prefixes (None until admitted), and the
    # snapshot slot of the latest page boundary its output reached (registered when it leaves; engine/scheduler.py).
    cached_tokens: int | None = None
    prompt_keys: list[bytes] | None = None  # its prompt's prefix-cache keys, a page boundary each
    prompt_boundaries: set[int] = field(default_factory=set)  # common prefixes others wait for it to snapshot
    output_snapshot: int | None = None
    output_snapshot_tokens: int = 0
    # The most tokens it may generate (`output_budget`), set when the engine adds it.
    max_output: int = field(init=False)
    stop_token_ids: frozenset[int] = field(init=False)
    stop_strings: StopStrings = field(init=False)

    def __post_init__(self) -> None:
        self.max_output = self.params.max_tokens
        self.stop_token_ids = frozenset(self.params.stop_token_ids)
        self.stop_strings = StopStrings(self.params.stop)
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without copying the whole request."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_in_flight

    @property
    def remaining_output(self) -> int:
        """Tokens it may still generate, the next one included."""
        return self.max_output - len(self.output_ids)

    @property
    def out_of_budget(self) -> bool:
        """Its tokens in flight end it (max_output): it is not run again, whatever they are."""
        return len(self.output_ids) + self.num_in_flight >= self.max_output

    @property
    def num_pending(self) -> int:
        """Tokens not yet run through the model: the rest of the prompt, or the last sampled token."""
        return self.num_tokens - self.num_computed

    @property
    def decoding(self) -> bool:
        """The whole prompt (and every output but the last sampled token) has been processed."""
        return self.num_pending == 1 and self.num_computed >= len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
