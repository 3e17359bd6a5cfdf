"""Next-token choice from logits: greedy, or temperature with top-k / top-p, per request, with optional seeds, under
the request's constraint (structured output) when it has one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob


class Constraint(Protocol):
    """Which tokens may come next for one request (the server's grammars implement it; the engine only calls it)."""

    def next_token(self, logits: torch.Tensor, remaining: int, draw: Callable[[torch.Tensor], int]) -> int:
        """Choose the next token, given the logits, the tokens the request may still generate (this one
        included) and `draw`, which samples a token from logits as the request's parameters say."""
        ...


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, remaining: int
) -> tuple[int, TokenLogprob | None]:
    """logits [V] fp32 -> (token id, its logprob record when asked). `remaining` is the request's token budget left,
    this token included. Logprobs are the model's, before any constraint's mask."""
    if params.constraint is None:
        token = _draw(logits, params, generator)
    else:
        token = params.constraint.next_token(logits, remaining, lambda masked: _draw(masked, params, generator))
    if params.logprobs is None:
        return token, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, params.logprobs) if params.logprobs else None
    top_map = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)} if top else {}
    return token, TokenLogprob(token, float(logprobs[token]), top_map)


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    scaled = logits / params.temperature
    if params.top_k:
        kth = torch.topk(scaled, min(params.top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = (torch.cumsum(sorted_probs, 0) - sorted_probs) >= params.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))
