"""Manifold-constrained hyper-connections (reference §4): the residual stream is `hc` parallel copies, mixed into a
sublayer's input by `pre`, out of it by `post`, and across copies by a doubly-stochastic `comb` (Sinkhorn).
The math is in engine/kernels/mhc.py (fused Triton kernels on CUDA, the plain-torch reference elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.mhc import HcMix, hc_head, hc_post_mix, hc_pre


class HyperConnection(nn.Module):
    """hc_pre / hc_post around one sublayer (attention or MoE)."""

    def __init__(self, hc: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(self, streams: torch.Tensor, mix: HcMix | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, hc, D] -> (sublayer input [N, D], post [N, hc], comb [N, hc, hc]), weights in fp32. `mix`: the
        streams' mixes with self.fn, from the hc_post that made them (`post_mix`)."""
        return hc_pre(streams, self.fn, self.base, self.scale, self.hc_eps, self.norm_eps, self.sinkhorn_iters, mix)

    @staticmethod
    def post_mix(
        out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, next_fn: torch.Tensor
    ) -> tuple[torch.Tensor, HcMix]:
        """H'_j = post_j * F + sum_i comb[i, j] * H_i, and H''s mixes with the weights `next_fn` of the hc_pre (or
        hc_head) that reads them next, in one pass."""
        return hc_post_mix(out, streams, post, comb, next_fn)


class HyperHead(nn.Module):
    """Collapses the streams once before the final norm (sigmoid weights, no Sinkhorn)."""

    def __init__(self, hc: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor, mix: HcMix | None = None) -> torch.Tensor:
        return hc_head(streams, self.fn, self.base, self.scale, self.hc_eps, self.norm_eps, mix)
