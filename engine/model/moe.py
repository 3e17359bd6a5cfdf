"""Mixture of experts (reference §6): hash routing (a token-id table) in the first layers, sqrt-softplus score
routing with bias-only selection after; clamped SwiGLU experts, routing weight applied before w2; one shared expert.

On CUDA a decode call is nine launches (eight in hash layers): router logits and selection (one in hash layers),
the pairs' counting sort, the routed gate/up and down, the shared expert's gate/up GEMM, its SwiGLU and its down
GEMM, and the sum of each token's picks with the shared expert in x's dtype. The counting sort also counts the experts
a call reads into `MoE.touched` when the serving runner points it at a counter (engine/model_runner.py)."""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.moe import gate_route, moe_combine, moe_expert_pairs, shared_swiglu
from engine.model.layers import FusedLinear


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
        """x [N, D] -> (weights [N, k] fp32, expert ids [N, k]); logits in fp32 from x and the weight as stored."""
        return gate_route(x, self.weight, self.bias, self.tid2eid, input_ids, self.top_k, self.route_scale)


class Experts(nn.Module):
    """All routed experts' weights, stacked: w1 (gate) and w3 (up) [E, I, D], w2 (down) [E, D, I]."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Parameter(torch.zeros(n_experts, inter, dim))
        self.w3 = nn.Parameter(torch.zeros(n_experts, inter, dim))
        self.w2 = nn.Parameter(torch.zeros(n_experts, dim, inter))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, touched: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N * k, D] in x's dtype, one row a (token, pick) pair: the grouped GEMM on CUDA, the reference's loop over
        picked experts elsewhere; the number of distinct experts picked is added to `touched` when given."""
        return moe_expert_pairs(x, weights, ids, self.w1, self.w3, self.w2, self.limit, touched)


class SharedExpert(nn.Module):
    """Every token, weight 1: dense matmuls (cuBLAS streams the matrices at full bandwidth). It stays out of the
    grouped GEMM because its weights are separate tensors and, in V4-Flash checkpoints, in another format (FP8) than
    the routed experts (FP4). w1 and w3 run as one GEMM over a [2I, D] weight their parameters are views of."""

    def __init__(self, dim: int, inter: int, limit: float):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.gate_up: FusedLinear | None = None  # not a submodule: its members are w1 and w3

    def fuse_projections(self) -> None:
        """Makes w1 and w3 views of one [2I, D] tensor, names and values unchanged, no memory duplicated. Call once
        the weights are final; forward fuses on first use too, and again whenever a parameter stopped being a view
        (a cast, a move to another device)."""
        self.gate_up = FusedLinear([self.w1, self.w3])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] in x's dtype."""
        if self.gate_up is None or not self.gate_up.intact():
            self.fuse_projections()
        gate, up = self.gate_up(x)
        return self.w2(shared_swiglu(gate, up, self.limit))


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
        # A one-element int64 counter on the device that each call adds its distinct routed experts to (a CUDA graph
        # keeps the address it was captured with), or None. Not a buffer: the runner owns the counters.
        self.touched: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """x [N, D] -> [N, D] in x's dtype: each token's k routed outputs summed in fp32 in pick order, plus the
        shared expert, rounded once."""
        weights, ids = self.gate(x, input_ids)
        return moe_combine(self.experts(x, weights, ids, self.touched), self.shared_experts(x), ids.shape[1])
