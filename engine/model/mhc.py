"""Manifold-constrained hyper-connections (reference §4): the residual stream is `hc` parallel copies, mixed into a
sublayer's input by `pre`, out of it by `post`, and across copies by a doubly-stochastic `comb` (Sinkhorn)."""

from __future__ import annotations

import torch
from torch import nn

from engine.model.layers import rms_normalize


class HyperConnection(nn.Module):
    """hc_pre / hc_post around one sublayer (attention or MoE)."""

    def __init__(self, hc: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc, self.sinkhorn_iters, self.hc_eps, self.norm_eps = hc, sinkhorn_iters, hc_eps, norm_eps
        mix = (2 + hc) * hc
        self.fn = nn.Parameter(torch.zeros(mix, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [N, hc, D] -> (sublayer input [N, D], post [N, hc], comb [N, hc, hc]), weights in fp32."""
        hc = self.hc
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        mixes = flat @ self.fn.T  # [N, (2+hc)*hc]
        pre = torch.sigmoid(mixes[:, :hc] * self.scale[0] + self.base[:hc]) + self.hc_eps
        post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * self.scale[1] + self.base[hc : 2 * hc])
        comb = mixes[:, 2 * hc :].view(-1, hc, hc) * self.scale[2] + self.base[2 * hc :].view(hc, hc)
        comb = torch.softmax(comb, dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.sinkhorn_iters - 1):  # alternate row and column normalisation
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        x = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
        return x.to(streams.dtype), post, comb

    @staticmethod
    def post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """H'_j = post_j * F + sum_i comb[i, j] * H_i."""
        mixed = post.unsqueeze(-1) * out.float().unsqueeze(1) + torch.einsum("nij,nid->njd", comb, streams.float())
        return mixed.to(streams.dtype)


class HyperHead(nn.Module):
    """Collapses the streams once before the final norm (sigmoid weights, no Sinkhorn)."""

    def __init__(self, hc: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.zeros(hc, hc * dim, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = rms_normalize(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid((flat @ self.fn.T) * self.scale + self.base) + self.hc_eps
        return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)
