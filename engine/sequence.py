"""One request as the engine tracks it: tokens so far, how far the model has processed them, its model state and
the KV pages it holds."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engine.cache.pool import PageTable
from engine.model.state import SequenceState
from engine.sampling_params import SamplingParams
from engine.tokenizer import IncrementalDetokenizer

_ids = itertools.count()


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
    # The pages of the tokens processed so far, shared with `state`: what the model's paged cache indexes.
    page_table: PageTable = field(default_factory=PageTable)
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

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
