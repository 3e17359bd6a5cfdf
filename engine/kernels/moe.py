"""Mixture of experts (reference §6): the router's selection and the routed experts as a capture-safe grouped GEMM.

Routing, from router logits [N, E] (fp32):

    s = sqrt(softplus(logits));  ids = tid2eid[token] (hash layers) or topk(s + bias, k) (the bias only selects);
    w = s[ids] / sum(s[ids]) * route_scale

Routed experts, for each token t and each of its k picks (e, w):

    y[t] += w2[e] @ (w * swiglu(w1[e] @ x[t], w3[e] @ x[t]))     (routing weight applied before w2)

Decode batches are small (1-64 tokens x 6 picks over 256 experts), so the experts are a weight-streaming problem: the
Triton path reads each touched expert's w1, w3 and w2 once per call and spreads them over the whole GPU.

  1. The N*k (token, pick) pairs are sorted by expert (a counting sort of fixed shapes); offsets[e] bound each
     expert's run; active[s] is the s-th expert that has pairs, E for none, for s < S = min(E, N*k).
  2. Grid (S, I / BLOCK_I): h[j] = w_j * swiglu(x[t_j] @ w1[e]^T, x[t_j] @ w3[e]^T) for the pairs j of expert e.
  3. Grid (S, D / BLOCK_D): y_pair[pair_j] = h[j] @ w2[e]^T, back in the pairs' original [N, k] order.
  4. y = y_pair.view(N, k, D).sum(1): each token's picks summed in a fixed order, so the result is deterministic.

Every shape depends on N, k and E only and nothing goes to the host, so a CUDA graph captured for a batch size replays
with any routing; programs whose slot holds no expert exit at once. A program streams its expert's weight tile once
when the expert has at most BLOCK_M pairs; more pairs loop over blocks of BLOCK_M, reading the tile again. BLOCK_M is
half the batch, 16 to 64: score routing picks an expert at most once a token, so up to 16 tokens it always fits, and
past that an expert rarely draws half the batch, while larger blocks take shared memory better spent on loads in
flight. Weights are [E, rows, K] with K contiguous and walked BLOCK_K at a time, so block-scaled FP8/FP4 weights can
later load a scale tile beside each weight tile.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, use_triton


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    if limit > 0:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return F.silu(gate) * up


def route_reference(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [N, E] fp32; bias [E] fp32 (score routing) or tid2eid [vocab, k] (hash routing); input_ids [N]
    -> (weights [N, k] fp32, expert ids [N, k] int64)."""
    scores = torch.sqrt(F.softplus(logits))
    if tid2eid is not None:
        ids = tid2eid[input_ids]
    else:
        # The bias only steers which experts are chosen; the weights come from the unbiased scores.
        ids = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * route_scale, ids


@triton.jit
def _softplus(x):
    """torch's softplus (x past 20 as is); log1p(t) as log(u) * t / (u - 1), u = 1 + t, stays exact for tiny t."""
    t = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + t
    fold = u - 1.0
    log1p = tl.where(fold == 0.0, t, tl.log(u) * (t / tl.where(fold == 0.0, 1.0, fold)))
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr, n, stride_ln, route_scale,
    E: tl.constexpr, TOP_K: tl.constexpr, HASHED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOP: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    e = tl.arange(0, BLOCK_E)
    j = tl.arange(0, BLOCK_TOP)
    valid = (t < n)[:, None] & (e < E)[None, :]
    logits = tl.load(logits_ptr + t[:, None] * stride_ln + e[None, :], mask=valid, other=0.0)
    scores = tl.sqrt_rn(_softplus(logits))
    if HASHED:
        token = tl.load(input_ids_ptr + t, mask=t < n, other=0)
    else:
        key = tl.where(valid, scores + tl.load(bias_ptr + e, mask=e < E, other=0.0)[None, :], float("-inf"))
    ids = tl.zeros([BLOCK_T, BLOCK_TOP], dtype=tl.int64)
    picked = tl.zeros([BLOCK_T, BLOCK_TOP], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        if HASHED:  # a row may name an expert twice: each pick is its own pair
            best = tl.load(tid2eid_ptr + token * TOP_K + i, mask=t < n, other=0).to(tl.int64)
        else:  # largest first, as torch.topk
            best = tl.argmax(key, axis=1).to(tl.int64)
            key = tl.where(e[None, :] == best[:, None], float("-inf"), key)
        ids = tl.where(j[None, :] == i, best[:, None], ids)
        score = tl.sum(tl.where(e[None, :] == best[:, None], scores, 0.0), axis=1)
        picked = tl.where(j[None, :] == i, score[:, None], picked)
    weights = picked / (tl.sum(picked, axis=1)[:, None] + 1e-20) * route_scale
    out = t[:, None] * TOP_K + j[None, :]
    mask = (t < n)[:, None] & (j < TOP_K)[None, :]
    tl.store(weights_ptr + out, weights, mask=mask)
    tl.store(ids_ptr + out, ids, mask=mask)


def route_triton(logits, bias, tid2eid, input_ids, top_k, route_scale, block_t: int = 16):
    n, n_experts = logits.shape
    weights = torch.empty(n, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    hashed = tid2eid is not None
    _route_kernel[(triton.cdiv(n, block_t),)](
        logits, logits if hashed else bias, tid2eid if hashed else ids, input_ids, weights, ids, n, logits.stride(0),
        route_scale, E=n_experts, TOP_K=top_k, HASHED=hashed, BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_TOP=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return weights, ids


def route(logits, bias, tid2eid, input_ids, top_k, route_scale):
    impl = route_triton if use_triton(logits.device) else route_reference
    return impl(logits, bias, tid2eid, input_ids, top_k, route_scale)


def moe_experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w3: torch.Tensor,
    w2: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """x [N, D]; weights [N, k] fp32; ids [N, k]; w1, w3 [E, I, D]; w2 [E, D, I] -> [N, D] fp32. A loop over the
    experts that were picked; each token's picks accumulate in fp32."""
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in torch.unique(ids).tolist():
        token, slot = torch.where(ids == e)
        xe = x[token]
        h = swiglu((xe @ w1[e].T).float(), (xe @ w3[e].T).float(), limit)
        h = h * weights[token, slot, None]
        out.index_add_(0, token, (h.to(x.dtype) @ w2[e].T).float())
    return out


@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _gate_up_kernel(
    x_ptr, w1_ptr, w3_ptr, pair_ptr, weights_ptr, active_ptr, offsets_ptr, h_ptr,
    stride_xn, stride_we, stride_wi, stride_hm, limit,
    E: tl.constexpr, TOP_K: tl.constexpr, D: tl.constexpr, CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """One program: one expert's rows [tile * BLOCK_I, +BLOCK_I) of w1 and w3, against all of that expert's pairs.
    Computed transposed (weights as the dot's M side, tokens as N) so the tile stays MMA-shaped for few tokens."""
    e = tl.load(active_ptr + tl.program_id(0))
    if e < E:
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        k = tl.arange(0, BLOCK_K)
        w_offs = e.to(tl.int64) * stride_we + i[:, None] * stride_wi + k[None, :]
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            valid = rows < end
            pair = tl.load(pair_ptr + rows, mask=valid, other=0)
            x_ptrs = x_ptr + (pair // TOP_K)[:, None] * stride_xn + k[None, :]
            gate = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
            up = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, D, BLOCK_K):
                xt = tl.trans(tl.load(x_ptrs + k0, mask=valid[:, None], other=0.0))
                gate = _dot(tl.load(w1_ptr + w_offs + k0), xt, gate, F32_DOT)
                up = _dot(tl.load(w3_ptr + w_offs + k0), xt, up, F32_DOT)
            if CLAMP:
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
            h = gate * tl.sigmoid(gate) * up * tl.load(weights_ptr + pair, mask=valid, other=0.0)[None, :]
            tl.store(h_ptr + rows[None, :] * stride_hm + i[:, None], h.to(h_ptr.dtype.element_ty), mask=valid[None, :])


@triton.jit
def _down_kernel(
    h_ptr, w2_ptr, pair_ptr, active_ptr, offsets_ptr, y_ptr,
    stride_hm, stride_we, stride_wd, stride_ym,
    E: tl.constexpr, INTER: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """One program: one expert's rows [tile * BLOCK_D, +BLOCK_D) of w2, against all of that expert's pairs."""
    e = tl.load(active_ptr + tl.program_id(0))
    if e < E:
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        k = tl.arange(0, BLOCK_K)
        w_ptrs = w2_ptr + e.to(tl.int64) * stride_we + d[:, None] * stride_wd + k[None, :]
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            valid = rows < end
            pair = tl.load(pair_ptr + rows, mask=valid, other=0)
            h_ptrs = h_ptr + rows[:, None] * stride_hm + k[None, :]
            acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
            for k0 in range(0, INTER, BLOCK_K):
                ht = tl.trans(tl.load(h_ptrs + k0, mask=valid[:, None], other=0.0))
                acc = _dot(tl.load(w_ptrs + k0), ht, acc, F32_DOT)
            tl.store(y_ptr + pair[None, :] * stride_ym + d[:, None], acc.to(y_ptr.dtype.element_ty),
                     mask=valid[None, :])  # fmt: skip


def group_pairs_by_expert(flat_ids: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stable counting sort of the (token, pick) pairs by expert, in a few fixed-shape launches (a radix sort of
    six pairs took 27 µs on an H200): order [P] (pair ids grouped by expert), offsets [E + 1] (expert e's pairs are
    order[offsets[e]:offsets[e + 1]]), active [E] (the experts that have pairs in ascending order, then E)."""
    experts = torch.arange(n_experts, device=flat_ids.device)
    one_hot = (flat_ids[:, None] == experts).int()  # [P, E]; F.one_hot would check the ids' range on the host
    counts = one_hot.sum(0)
    offsets = torch.zeros(n_experts + 1, dtype=torch.long, device=flat_ids.device)
    offsets[1:] = counts.cumsum(0)
    # A pair's rank: the pairs of smaller experts, then the earlier pairs of its own expert.
    within = one_hot.cumsum(0).gather(1, flat_ids[:, None]).squeeze(1) - 1
    order = torch.empty_like(flat_ids)
    order.scatter_(0, offsets[flat_ids] + within, torch.arange(len(flat_ids), device=flat_ids.device))
    has_pairs = counts > 0
    # Experts without pairs all land on the spare slot E, which is cut off.
    active = torch.full((n_experts + 1,), n_experts, dtype=torch.long, device=flat_ids.device)
    rank = torch.where(has_pairs, has_pairs.cumsum(0) - 1, n_experts)
    active.scatter_(0, rank, experts)
    return order, offsets, active[:n_experts]


def moe_experts_triton(
    x, weights, ids, w1, w3, w2, limit, block_m: int | None = None, block_i: int = 32, block_d: int = 64,
    block_k: int = 128, num_warps: int = 4, num_stages: int = 4,
):  # fmt: skip
    n, dim = x.shape
    n_experts, inter, _ = w1.shape
    top_k = ids.shape[1]
    pairs = n * top_k
    if pairs == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    block_m = block_m or min(64, max(16, triton.next_power_of_2(n) // 2))
    block_i, block_d = min(block_i, inter), min(block_d, dim)
    block_k_up, block_k_down = min(block_k, dim), min(block_k, inter)
    if inter % block_i or dim % block_d or dim % block_k_up or inter % block_k_down or w1.stride() != w3.stride():
        raise ValueError(f"expert shapes D={dim}, I={inter} do not tile by {block_i}, {block_d}, {block_k}")
    x = x.contiguous()
    order, offsets, active = group_pairs_by_expert(ids.reshape(-1), n_experts)
    slots = min(n_experts, pairs)
    active = active[:slots]
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # x's dtype before w2, as the reference
    y = torch.empty(pairs, dim, dtype=x.dtype, device=x.device)
    f32_dot = x.dtype == torch.float32 or interpreting()
    _gate_up_kernel[(slots, inter // block_i)](
        x, w1, w3, order, weights.reshape(-1), active, offsets, h,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), limit,
        E=n_experts, TOP_K=top_k, D=dim, CLAMP=limit > 0,
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_K=block_k_up, F32_DOT=f32_dot,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _down_kernel[(slots, dim // block_d)](
        h, w2, order, active, offsets, y,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        E=n_experts, INTER=inter, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_K=block_k_down, F32_DOT=f32_dot,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y.view(n, top_k, dim).sum(1, dtype=torch.float32)


def moe_experts(x, weights, ids, w1, w3, w2, limit):
    impl = moe_experts_triton if use_triton(x.device) else moe_experts_reference
    return impl(x, weights, ids, w1, w3, w2, limit)
