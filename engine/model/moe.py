"""Mixture of experts (reference §6): hash routing (a token-id table) in the first layers, sqrt-softplus score
routing with bias-only selection after; clamped SwiGLU experts, routing weight applied before w2; one shared expert."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.moe import moe_experts, route, swiglu


class Gate(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int, route_scale: float, vocab_size: int, hashed: bool):
        super().__init__()
        self.top_k, self.route_scale = top_k, route_scale
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, top_k, dtype=torch.long))
            self.bias = None
        else:
            self.tid2eid = None
            self.bias = nn.Parameter(torch.zeros(n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k])."""
        logits = x.float() @ self.weight.float().T  # routing in fp32, as the reference
        return route(logits, self.bias, self.tid2eid, input_ids, self.top_k, self.route_scale)


class Experts(nn.Module):
    """All routed experts' weights, stacked: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.zeros(n_experts, inter, dim))
        self.w3 = nn.Parameter(torch.zeros(n_experts, inter, dim))
        self.w2 = nn.Parameter(torch.zeros(n_experts, dim, inter))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[N, D] fp32: the grouped GEMM on CUDA, the reference's loop over picked experts elsewhere."""
        return moe_experts(x, weights, ids, self.w1, self.w3, self.w2, self.limit)


class SharedExpert(nn.Module):
    """Every token, weight 1: dense matmuls (cuBLAS streams the three matrices at full bandwidth). It stays out of the
    grouped GEMM because its weights are separate tensors and, in V4-Flash checkpoints, in another format (FP8) than
    the routed experts (FP4)."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = swiglu(self.w1(x).float(), self.w3(x).float(), self.limit)
        return self.w2(h.to(x.dtype)).float()


class MoE(nn.Module):
    def __init__(self, args, layer_id: int):
        super().__init__()
        dim, inter = args.hidden_size, args.moe_intermediate_size
        self.gate = Gate(
            dim,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.routed_scaling_factor,
            args.vocab_size,
            hashed=layer_id < args.num_hash_layers,
        )
        self.experts = Experts(args.n_routed_experts, dim, inter, args.swiglu_limit)
        self.shared_experts = SharedExpert(dim, inter, args.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x, input_ids)
        return (self.experts(x, weights, ids) + self.shared_experts(x)).to(x.dtype)
