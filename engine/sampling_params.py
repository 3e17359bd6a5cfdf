"""How one request is sampled and when it stops."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampler import Constraint

# Below this temperature sampling is greedy: dividing logits by it would overflow fp32 to inf, and the softmax of
# such logits is NaN (vLLM draws the same line).
GREEDY_BELOW_TEMPERATURE = 1e-5
# What torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer.
SEED_RANGE = range(-(1 << 63), 1 << 64)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # stop strings, not included in the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # None: none; N: the chosen token's logprob and the N most likely
    # Structured output: a rule on which token may come next. It holds the request's state, so one per request.
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.seed is not None and self.seed not in SEED_RANGE:
            raise ValueError(f"seed must be a 64-bit integer (from -2**63 to 2**64 - 1), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW_TEMPERATURE
