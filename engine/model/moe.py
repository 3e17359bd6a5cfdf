"""Mixture of experts (reference §6): hash routing (a token-id table) in the first layers, sqrt-softplus score
routing with bias-only selection after; clamped SwiGLU experts, routing weight applied before w2; one shared expert.

On CUDA a decode call is nine launches (eight in hash layers): router logits and selection (one in hash layers),
the pairs' counting sort, the routed gate/up and down, the shared expert's gate/up GEMM, its SwiGLU and its down
GEMM, and the sum of each token's picks with the shared expert in x's dtype. The counting sort also counts the experts
a call reads into `MoE.touched` when the serving runner points it at a counter (engine/model_runner.py)."""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import torch
from torch import nn

from engine.distributed import all_reduce, gather_rows, reduce_scatter_rows
from engine.kernels.moe import gate_route, moe_combine, shared_swiglu
from engine.model.linear import Layout, ProjectionGroup, RowParallelLinear, Shard
from engine.model.weight_formats import Formats, Region, WeightFormat
from engine.model.weights import WeightEntry


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


class ExpertWeights(nn.Module):
    """One projection of a range of experts, stacked, in the experts' format: [experts, rows, cols] weights."""

    def __init__(self, experts: int, rows: int, cols: int, fmt: WeightFormat):
        super().__init__()
        for name, param in fmt.create(rows, cols, experts=experts).items():
            self.register_parameter(name, param)

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters())

    def expert(self, i: int) -> dict[str, torch.Tensor]:
        return {name: param[i] for name, param in self.named_parameters()}


class Experts(nn.Module):
    """The routed experts [first, first + count) of `n_experts` (all of them on one GPU; a range per rank when they
    are split): w1 (gate) and w3 (up) [count, I, D], w2 (down) [count, D, I]; checkpoint members
    `{prefix}.{e}.w1` ... with e the global expert id. A pick of an expert another rank holds gives a zero row."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float, prefix: str, fmt: WeightFormat,
                 shard: Shard):  # fmt: skip
        super().__init__()
        self.limit, self.prefix, self.fmt = limit, prefix, fmt
        self.first, self.count = shard.part(n_experts, f"{prefix} experts")
        self.split = shard.size > 1
        self.shapes = {"w1": (inter, dim), "w3": (inter, dim), "w2": (dim, inter)}
        self.w1, self.w3, self.w2 = (ExpertWeights(self.count, *self.shapes[w], fmt) for w in ("w1", "w3", "w2"))

    def weight_entries(self) -> Iterator[WeightEntry]:
        for i in range(self.count):
            for w, (rows, cols) in self.shapes.items():
                params = getattr(self, w).expert(i)
                load = partial(self.fmt.load, params, full=(rows, cols), src=Region.whole(rows, cols), dst_row=0)
                yield WeightEntry(f"{self.prefix}.{self.first + i}.{w}", lambda stored, load=load: load(stored=stored),
                                  partial(self.fmt.stored, params, 0, rows))  # fmt: skip

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, touched: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N * k, D] in x's dtype, one row a (token, pick) pair: the grouped GEMM on CUDA, the reference's loop over
        picked experts elsewhere; the number of distinct experts of this rank picked is added to `touched` when
        given. `ids` are global: the kernels see this rank's experts as 0 .. count - 1 and any other pick as `count`
        (its row stays zero)."""
        if self.split:
            local = ids - self.first
            ids = torch.where((local >= 0) & (local < self.count), local, self.count)
        return self.fmt.expert_pairs(self.w1.params(), self.w3.params(), self.w2.params(), x, weights, ids,
                                     self.limit, touched, remote=self.split)  # fmt: skip


class SharedExpert(nn.Module):
    """Every token, weight 1: dense matmuls (cuBLAS streams the matrices at full bandwidth). It stays out of the
    grouped GEMM because its weights are separate tensors and, in V4-Flash checkpoints, in another format (FP8) than
    the routed experts (FP4). w1 and w3 are one merged GEMM (split by output features), w2 row-parallel, its
    partial sums left for the MoE's one reduction."""

    def __init__(self, dim: int, inter: int, limit: float, prefix: str, formats: Formats, shard: Shard):
        super().__init__()
        self.limit = limit
        self.gate_up = ProjectionGroup(dim, [(f"{prefix}.{w}", inter, formats.linear(f"{prefix}.{w}"), True)
                                             for w in ("w1", "w3")], shard)  # fmt: skip
        self.w2 = RowParallelLinear(inter, [(f"{prefix}.w2", dim)], formats.linear(f"{prefix}.w2"), shard,
                                    reduce=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] in x's dtype (this rank's partial sum when the shared expert is split)."""
        gate, up = self.gate_up(x)
        return self.w2(shared_swiglu(gate, up, self.limit))


class MoE(nn.Module):
    """`formats`, `layout`: the model's (engine/model/deepseek_v4.py); by default plain weights on one GPU.

    Over several ranks each holds a range of the routed experts and computes the pairs that picked them. With
    tensor-parallel attention every rank has the same tokens: its routed pairs and its part of the (split) shared
    expert are summed per token, then over the ranks, one all-reduce. With data-parallel attention each rank has its
    own tokens: they are gathered (padded to the step's agreed rows), routed on every rank alike, each rank's pairs
    summed per token, and the sums over the ranks scattered back, each rank its own rows; the shared expert
    (replicated) runs on the rank's own tokens."""

    def __init__(self, args, layer_id: int, formats: Formats | None = None, layout: Layout | None = None):
        super().__init__()
        formats, layout, prefix = formats or Formats(), layout or Layout(), f"{args.block_name(layer_id)}.ffn"
        dim, inter = args.hidden_size, args.moe_intermediate_size
        self.gate = Gate(
            dim,
            args.n_routed_experts,
            args.num_experts_per_tok,
            args.routed_scaling_factor,
            args.vocab_size,
            hashed=layer_id < args.num_hash_layers,
        )
        self.experts = Experts(args.n_routed_experts, dim, inter, args.swiglu_limit, f"{prefix}.experts",
                               formats.routed(f"{prefix}.experts"), layout.experts)  # fmt: skip
        self.data_parallel = layout.data_parallel
        self.shared_experts = SharedExpert(dim, inter, args.swiglu_limit, f"{prefix}.shared_experts", formats,
                                           layout.attention)  # fmt: skip
        # A one-element int64 counter on the device that each call adds its distinct routed experts to (a CUDA graph
        # keeps the address it was captured with), or None. Not a buffer: the runner owns the counters.
        self.touched: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, moe_rows: int | None = None) -> torch.Tensor:
        """x [N, D] -> [N, D] in x's dtype: each token's k routed outputs summed in fp32 in pick order, plus the
        shared expert, rounded once (on one rank). `moe_rows`: ForwardBatch's."""
        if self.data_parallel:
            rows = moe_rows or len(x)
            tokens, token_ids = gather_rows(x, rows), gather_rows(input_ids, rows)
            weights, ids = self.gate(tokens, token_ids)
            pairs = self.experts(tokens, weights, ids, self.touched)
            routed = reduce_scatter_rows(moe_combine(pairs, torch.zeros_like(tokens), ids.shape[1]))
            return routed[: len(x)] + self.shared_experts(x)
        weights, ids = self.gate(x, input_ids)
        out = moe_combine(self.experts(x, weights, ids, self.touched), self.shared_experts(x), ids.shape[1])
        return all_reduce(out) if self.experts.split else out
