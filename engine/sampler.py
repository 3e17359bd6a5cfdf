"""Next-token choice from logits: greedy, or temperature with top-k / top-p, per request, with optional seeds."""

from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprob


def sample(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[int, TokenLogprob | None]:
    """logits [V] fp32 -> (token id, its logprob record when asked)."""
    if params.greedy:
        token = int(torch.argmax(logits))
    else:
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
        token = int(torch.multinomial(probs.cpu(), 1, generator=generator))
    if params.logprobs is None:
        return token, None
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, params.logprobs) if params.logprobs else None
    top_map = {int(i): float(v) for v, i in zip(top.values, top.indices, strict=True)} if top else {}
    return token, TokenLogprob(token, float(logprobs[token]), top_map)
