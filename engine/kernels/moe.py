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
  4. moe_combine: out[t] = sum_j y_pair[t * k + j] + shared[t] in fp32, picks in order, written in x's dtype (one
     launch, deterministic); moe_experts_triton sums the picks alone, for the grouped-GEMM bench and tests.

Around them, the MoE block's small launches are single kernels too: gate_route computes the router logits from x
and the weight as stored (programs over expert blocks x splits of D, the splits added in a fixed order by the
selection kernel: two launches; hash layers one, with only the picked experts' logits), group_pairs_by_expert is one
launch, and shared_swiglu reads the shared expert's two projections and writes h in x's dtype. The counting sort also
adds the number of experts that got pairs (the experts the call reads) to a counter on the device when given one, for
the serving metrics: no launch and no host sync of its own.

Token and pair counts are runtime arguments Triton does not specialise on (it would compile a variant for 1, for
multiples of 16 and for the rest), and tiles follow the power of two above the token (or pair) count, so the compiled
variants are few and boot makes them all (engine/boot.py).

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

from engine.kernels.dispatch import interpreting, multiprocessors, use_triton, wide


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
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


def gate_route_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tid2eid: torch.Tensor | None,
    input_ids: torch.Tensor,
    top_k: int,
    route_scale: float,
    logits_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate from x [N, D] and the router weight [E, D]: logits as an fp32 matmul of the upcast tensors, then
    route_reference. logits_out [N, E] fp32, when given, receives the logits (score routing; for checks)."""
    x = wide(x)
    logits = x @ weight.to(x.dtype).T
    if logits_out is not None:
        logits_out.copy_(logits)
    return route_reference(logits, bias, tid2eid, input_ids, top_k, route_scale)


@triton.jit(do_not_specialize=["n"])
def _router_logits_kernel(
    x_ptr, w_ptr, partial_ptr, n, stride_xn, stride_we,
    E: tl.constexpr, D: tl.constexpr, K_SPLIT: tl.constexpr,
    BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
):  # fmt: skip
    """Programs over (expert blocks, splits of D, token blocks): partial[split, t, e] = x[t, slice] . w[e, slice],
    exact products (bf16 x bf16 on the tensor cores, else both upcast to fp32 and an ieee dot), accumulated in fp32.
    The whole GPU streams the router weight in its stored dtype; the route kernel adds the splits in a fixed order."""
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    split = tl.program_id(1)
    t = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_E, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, BLOCK_K):
        kk = k0 + k
        w = tl.load(w_ptr + e[:, None] * stride_we + kk[None, :], mask=(e < E)[:, None] & (kk < D)[None, :], other=0.0)
        xt = tl.load(x_ptr + t[None, :] * stride_xn + kk[:, None], mask=(t < n)[None, :] & (kk < D)[:, None],
                     other=0.0)  # fmt: skip
        acc = _dot(w, xt, acc, F32_DOT)
    out = (split * n + t[None, :]).to(tl.int64) * E + e[:, None]
    tl.store(partial_ptr + out, acc, mask=(e < E)[:, None] & (t < n)[None, :])


@triton.jit(do_not_specialize=["n"])
def _score_route_kernel(
    partial_ptr, bias_ptr, weights_ptr, ids_ptr, logits_ptr, n, route_scale,
    E: tl.constexpr, TOP_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_E: tl.constexpr, STORE_LOGITS: tl.constexpr,
):  # fmt: skip
    """One program a token: its logits (the splits summed in order), s = sqrt(softplus), the top-k of s + bias by
    k argmax passes (largest first, ties to the smaller expert), then each picked expert's weight and id written at
    its rank: one reduction for the weights' sum, none per pick."""
    t = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        logits += tl.load(partial_ptr + (s * n + t).to(tl.int64) * E + e, mask=valid, other=0.0)
    if STORE_LOGITS:
        tl.store(logits_ptr + t.to(tl.int64) * E + e, logits, mask=valid)
    scores = tl.sqrt_rn(_softplus(logits))
    key = tl.where(valid, scores + tl.load(bias_ptr + e, mask=valid, other=0.0), float("-inf"))
    rank = tl.full([BLOCK_E], TOP_K, dtype=tl.int32)  # the pick's place; TOP_K: not picked
    for i in tl.static_range(TOP_K):
        best = tl.argmax(key, axis=0)
        rank = tl.where(e == best, i, rank)
        key = tl.where(e == best, float("-inf"), key)
    picked = rank < TOP_K
    total = tl.sum(tl.where(picked, scores, 0.0), axis=0)
    out = t.to(tl.int64) * TOP_K + rank
    tl.store(weights_ptr + out, scores / (total + 1e-20) * route_scale, mask=picked)
    tl.store(ids_ptr + out, e.to(tl.int64), mask=picked)


@triton.jit
def _hash_route_kernel(
    x_ptr, w_ptr, tid2eid_ptr, input_ids_ptr, weights_ptr, ids_ptr, stride_xn, stride_we, stride_table, route_scale,
    D: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOP: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One program a token of a hash layer: its k experts from the table (an expert may come twice), and only
    those k logits (the rows of w it names against x, fp32 products, fp32 sums) for the weights."""
    t = tl.program_id(0)
    j = tl.arange(0, BLOCK_TOP)
    token = tl.load(input_ids_ptr + t).to(tl.int64)
    ids = tl.load(tid2eid_ptr + token * stride_table + j, mask=j < TOP_K, other=0).to(tl.int64)
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_TOP, BLOCK_K], dtype=tl.float32)
    for k0 in tl.static_range(0, D, BLOCK_K):
        kk = k0 + k
        xk = tl.load(x_ptr + t.to(tl.int64) * stride_xn + kk, mask=kk < D, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ids[:, None] * stride_we + kk[None, :], mask=(j < TOP_K)[:, None] & (kk < D)[None, :],
                    other=0.0)  # fmt: skip
        acc += w.to(tl.float32) * xk[None, :]
    scores = tl.where(j < TOP_K, tl.sqrt_rn(_softplus(tl.sum(acc, axis=1))), 0.0)
    weights = scores / (tl.sum(scores, axis=0) + 1e-20) * route_scale
    out = t.to(tl.int64) * TOP_K + j
    tl.store(weights_ptr + out, weights, mask=j < TOP_K)
    tl.store(ids_ptr + out, ids, mask=j < TOP_K)


def gate_route_triton(
    x, weight, bias, tid2eid, input_ids, top_k, route_scale, logits_out=None, *, block_e: int = 32,
    block_k: int = 128, f32_dot: bool | None = None, route_warps: int = 4,
):  # fmt: skip
    """Score layers: two launches (partial logits over the whole GPU, then one program a token for the selection);
    hash layers: one (only the picked experts' logits). No dtype copies: x and the weight are read as stored. The
    products are exact either way: bf16 (or fp16) x and weight meet on the tensor cores, anything else (fp32, mixed
    dtypes, the interpreter) upcasts both to fp32 for an ieee dot."""
    n, dim = x.shape
    n_experts = weight.shape[0]
    weights = torch.empty(n, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(n, top_k, dtype=torch.int64, device=x.device)
    if n == 0:
        return weights, ids
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if tid2eid is not None:
        _hash_route_kernel[(n,)](
            x, weight, tid2eid, input_ids, weights, ids, x.stride(0), weight.stride(0), tid2eid.stride(0),
            route_scale, D=dim, TOP_K=top_k, BLOCK_TOP=triton.next_power_of_2(top_k),
            BLOCK_K=min(512, triton.next_power_of_2(dim)), num_warps=8,
        )  # fmt: skip
        return weights, ids
    if f32_dot is None:
        f32_dot = x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16) or interpreting()
    block_e = min(block_e, max(16, triton.next_power_of_2(n_experts)))
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(block_k, max(16, triton.next_power_of_2(dim)))
    e_blocks, n_blocks, k_blocks = triton.cdiv(n_experts, block_e), triton.cdiv(n, block_n), triton.cdiv(dim, block_k)
    # Splits of D (a power of two, at most 32) until about two programs an SM, counting the token blocks up to a power
    # of two: the splits depend on the power of two above N only, as the tiles do (few compiled variants).
    programs = e_blocks * triton.next_power_of_2(n_blocks)
    splits = 1
    while splits < 32 and 2 * splits <= k_blocks and programs * splits * 2 <= 2 * multiprocessors(x.device):
        splits *= 2
    k_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(dim, k_split)
    partial = torch.empty(splits, n, n_experts, dtype=torch.float32, device=x.device)
    _router_logits_kernel[(e_blocks, splits, n_blocks)](
        x, weight, partial, n, x.stride(0), weight.stride(0), E=n_experts, D=dim, K_SPLIT=k_split,
        BLOCK_E=block_e, BLOCK_N=block_n, BLOCK_K=block_k, F32_DOT=f32_dot, num_warps=4,
    )  # fmt: skip
    _score_route_kernel[(n,)](
        partial, bias, weights, ids, partial if logits_out is None else logits_out, n, route_scale,
        E=n_experts, TOP_K=top_k, SPLITS=splits, BLOCK_E=triton.next_power_of_2(n_experts),
        STORE_LOGITS=logits_out is not None, num_warps=route_warps,
    )  # fmt: skip
    return weights, ids


def gate_route(x, weight, bias, tid2eid, input_ids, top_k, route_scale, logits_out=None):
    impl = gate_route_triton if use_triton(x.device) else gate_route_reference
    return impl(x, weight, bias, tid2eid, input_ids, top_k, route_scale, logits_out)


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


def group_pairs_by_expert_reference(
    flat_ids: torch.Tensor, n_experts: int, touched: torch.Tensor | None = None, counted: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stable counting sort of the (token, pick) pairs by expert, in plain torch: order [P] (pair ids grouped by
    expert), offsets [E + 1] (expert e's pairs are order[offsets[e]:offsets[e + 1]]), active [E] (the experts that
    have pairs in ascending order, then E). touched, a one-element int64 counter, gets the number of experts below
    `counted` (default: all) that have pairs added."""
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
    if touched is not None:
        touched += has_pairs[:counted].sum()
    # Experts without pairs all land on the spare slot E, which is cut off.
    active = torch.full((n_experts + 1,), n_experts, dtype=torch.long, device=flat_ids.device)
    rank = torch.where(has_pairs, has_pairs.cumsum(0) - 1, n_experts)
    active.scatter_(0, rank, experts)
    return order, offsets, active[:n_experts]


# The counter's address is an element of a table (any 8-byte alignment): one compiled variant for all of them.
@triton.jit(do_not_specialize=["P"], do_not_specialize_on_alignment=["touched_ptr"])
def _group_pairs_kernel(
    ids_ptr, order_ptr, offsets_ptr, active_ptr, touched_ptr, P,
    E: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_MINE: tl.constexpr, BLOCK_P: tl.constexpr, COUNT: tl.constexpr,
    COUNTED: tl.constexpr,
):  # fmt: skip
    """One program: the experts [pid * BLOCK_MINE, +BLOCK_MINE). Every program counts all pairs by expert (a
    histogram), which gives its experts' offsets and active slots; then it places its experts' pairs, each at its
    expert's offset plus the number of earlier pairs of that expert (a running count and a prefix sum along the
    pairs), so the order within an expert is the pairs' order. Programs write disjoint entries. With COUNT, the
    first program adds the number of experts below COUNTED with pairs to *touched_ptr."""
    e = tl.arange(0, BLOCK_E)
    mine = tl.program_id(0) * BLOCK_MINE + tl.arange(0, BLOCK_MINE)
    q = tl.arange(0, BLOCK_P)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for p0 in range(0, P, BLOCK_P):
        p = p0 + q
        ids = tl.load(ids_ptr + p, mask=p < P, other=0).to(tl.int32)
        counts += tl.histogram(ids, BLOCK_E, mask=p < P)
    before = e[:, None] < mine[None, :]  # [BLOCK_E, BLOCK_MINE]
    start = tl.sum(tl.where(before, counts[:, None], 0), axis=0)
    has = counts > 0
    slot = tl.sum((before & has[:, None]).to(tl.int32), axis=0)
    n_active = tl.sum(has.to(tl.int32), axis=0)
    if COUNT:
        n_counted = tl.sum((has & (e < COUNTED)).to(tl.int32), axis=0)
        tl.atomic_add(touched_ptr, n_counted.to(tl.int64), mask=tl.program_id(0) == 0)
    own = tl.sum(tl.where(e[:, None] == mine[None, :], counts[:, None], 0), axis=0)
    in_range = mine < E
    tl.store(offsets_ptr + mine + 1, start + own, mask=in_range)
    tl.store(offsets_ptr + mine, 0, mask=mine == 0)
    tl.store(active_ptr + slot, mine, mask=in_range & (own > 0))
    tl.store(active_ptr + mine, E, mask=in_range & (mine >= n_active))
    running = start
    for p0 in range(0, P, BLOCK_P):
        p = p0 + q
        ids = tl.load(ids_ptr + p, mask=p < P, other=0)
        hit = ((mine[:, None] == ids[None, :]) & (p < P)[None, :]).to(tl.int32)  # [BLOCK_MINE, BLOCK_P]
        place = running[:, None] + tl.cumsum(hit, axis=1) - 1
        tl.store(order_ptr + place, p[None, :] + tl.zeros_like(place), mask=hit != 0)
        running += tl.sum(hit, axis=1)


def group_pairs_by_expert_triton(
    flat_ids: torch.Tensor, n_experts: int, touched: torch.Tensor | None = None, counted: int | None = None,
    block_mine: int = 4, num_warps: int = 4,
):  # fmt: skip
    """group_pairs_by_expert_reference in one launch of cdiv(E, block_mine) programs (the grid depends on E only)."""
    pairs = flat_ids.numel()
    order = torch.empty(pairs, dtype=torch.int64, device=flat_ids.device)
    offsets = torch.empty(n_experts + 1, dtype=torch.int64, device=flat_ids.device)
    active = torch.empty(n_experts, dtype=torch.int64, device=flat_ids.device)
    block_mine = min(block_mine, triton.next_power_of_2(n_experts))
    _group_pairs_kernel[(triton.cdiv(n_experts, block_mine),)](
        flat_ids, order, offsets, active, flat_ids if touched is None else touched, pairs, E=n_experts,
        BLOCK_E=triton.next_power_of_2(n_experts), BLOCK_MINE=block_mine,
        BLOCK_P=min(512, max(16, triton.next_power_of_2(pairs))), COUNT=touched is not None,
        COUNTED=n_experts if counted is None else counted, num_warps=num_warps,
    )  # fmt: skip
    return order, offsets, active


def moe_expert_pairs_reference(x, weights, ids, w1, w3, w2, limit, touched=None, remote=False):
    """x [N, D]; weights [N, k] fp32; ids [N, k]; w1, w3 [E, I, D]; w2 [E, D, I] -> [N * k, D] in x's dtype: each
    (token, pick) pair's routed output, pair t * k + j for token t's pick j (moe_combine sums them). An id of E is a
    pick of an expert another rank holds (`remote`: there may be some): its row is zero. touched, a one-element
    int64 counter, gets the number of distinct experts picked (of the E) added."""
    n, top_k = ids.shape
    n_experts = len(w1)
    out = torch.zeros(n * top_k, x.shape[1], dtype=x.dtype, device=x.device)
    flat, flat_weights = ids.reshape(-1), weights.reshape(-1)
    # Every expert's pairs in one batched product of [E, C] slots (C: the most pairs an expert has; the rest of an
    # expert's slots are zeros), grouped with one sort and one host read of the counts. A loop over the experts made
    # ~17 launches each, most of a training step's MoE; the gathers are index_select and index_copy, whose backward
    # (training's) adds where advanced indexing's sorts. The price: E x C rows of activations, more than the loop's
    # when routing is skewed (this reference serves the CPU and training; CUDA serving runs the kernels).
    # Not bincount: on CUDA it reads its input's maximum on the host (two waits for the device a call).
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=x.device)
    counts.scatter_add_(0, flat.long(), torch.ones_like(flat, dtype=torch.int64))  # hash tables' ids may be int32
    host = counts.tolist()
    if touched is not None:
        touched += sum(1 for c in host[:n_experts] if c)
    capacity = max(host[:n_experts], default=0)
    if capacity == 0:
        return out
    order = torch.argsort(flat, stable=True)[: len(flat) - host[n_experts]]  # another rank's picks (id E) sort last
    expert = flat.index_select(0, order)
    rank = torch.arange(len(order), device=x.device) - (counts.cumsum(0) - counts).index_select(0, expert)
    slot = expert * capacity + rank
    xe = x.new_zeros(n_experts * capacity, x.shape[1]).index_copy(0, slot, x.index_select(0, order // top_k))
    we = flat_weights.new_zeros(n_experts * capacity).index_copy(0, slot, flat_weights.index_select(0, order))
    xe = xe.view(n_experts, capacity, -1)
    h = swiglu(wide(torch.bmm(xe, w1.transpose(1, 2))), wide(torch.bmm(xe, w3.transpose(1, 2))), limit)
    h = (h * we.view(n_experts, capacity, 1)).to(x.dtype)
    routed = torch.bmm(h, w2.transpose(1, 2)).view(n_experts * capacity, -1)
    return out.index_copy(0, order, routed.index_select(0, slot))


# Launch parameters by the call's token count (bench/moe.py's sweep for decode batches; bench/results/prefix.md for
# a cached turn's prefill): a decode batch gives an expert a few pairs; a prefill chunk gives it tens, which wider
# tiles read from L2 fewer times over (each program of a kernel reads all of its expert's pairs).
DECODE_LAUNCH = {"block_i": 32, "block_d": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
PREFILL_LAUNCH = {"block_i": 64, "block_d": 256, "block_k": 64, "num_warps": 8, "num_stages": 3}
PREFILL_TOKENS = 64  # above this many tokens, PREFILL_LAUNCH


def _dividing(block: int, size: int) -> int:
    """The widest power-of-two tile up to `block` that divides `size`: a width that is not a power of two (the demo
    model's 320) takes narrower tiles rather than masks."""
    block = min(block, triton.next_power_of_2(size))
    while size % block:
        block //= 2
    return block


def moe_expert_pairs_triton(
    x, weights, ids, w1, w3, w2, limit, touched=None, remote=False, block_m: int | None = None, **launch
):  # fmt: skip
    """Three launches: the counting sort (which counts the experts touched), then gate/up and down over the active
    experts (`remote`: the sort has a bucket E for the other ranks' picks, which no program computes, and the output
    starts zeroed). `launch`: block_i, block_d, block_k, num_warps, num_stages instead of the defaults for N."""
    n, dim = x.shape
    n_experts, inter, _ = w1.shape
    top_k = ids.shape[1]
    pairs = n * top_k
    if pairs == 0:
        return torch.zeros(pairs, dim, dtype=x.dtype, device=x.device)
    launch = (PREFILL_LAUNCH if n > PREFILL_TOKENS else DECODE_LAUNCH) | launch
    block_i, block_d, block_k = launch["block_i"], launch["block_d"], launch["block_k"]
    num_warps, num_stages = launch["num_warps"], launch["num_stages"]
    block_m = block_m or min(64, max(16, triton.next_power_of_2(n) // 2))
    block_i, block_d = _dividing(block_i, inter), _dividing(block_d, dim)
    block_k_up, block_k_down = _dividing(block_k, dim), _dividing(block_k, inter)
    if min(block_i, block_d, block_k_up, block_k_down) < 16 or w1.stride() != w3.stride():
        raise ValueError(f"expert shapes D={dim}, I={inter} do not tile by 16 (or w1 and w3 are laid out apart)")
    x = x.contiguous()
    order, offsets, active, y = sort_pairs(ids, n_experts, touched, remote, dim, x)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # x's dtype before w2, as the reference
    f32_dot = x.dtype == torch.float32 or interpreting()
    _gate_up_kernel[(len(active), inter // block_i)](
        x, w1, w3, order, weights.reshape(-1), active, offsets, h,
        x.stride(0), w1.stride(0), w1.stride(1), h.stride(0), limit,
        E=n_experts, TOP_K=top_k, D=dim, CLAMP=limit > 0,
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_K=block_k_up, F32_DOT=f32_dot,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _down_kernel[(len(active), dim // block_d)](
        h, w2, order, active, offsets, y,
        h.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        E=n_experts, INTER=inter, BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_K=block_k_down, F32_DOT=f32_dot,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def sort_pairs(ids, n_experts: int, touched, remote: bool, dim: int, x: torch.Tensor):
    """The expert kernels' set-up: the pairs' counting sort (with a bucket E for other ranks' picks when `remote`),
    the active experts a program each, and the output rows (zeroed when some stay uncomputed)."""
    buckets = n_experts + remote
    order, offsets, active = group_pairs_by_expert_triton(ids.reshape(-1), buckets, touched, counted=n_experts)
    pairs = ids.numel()
    out = (torch.zeros if remote else torch.empty)(pairs, dim, dtype=x.dtype, device=x.device)
    return order, offsets, active[: min(buckets, pairs)], out


def moe_expert_pairs(x, weights, ids, w1, w3, w2, limit, touched=None, remote=False):
    impl = moe_expert_pairs_triton if use_triton(x.device) else moe_expert_pairs_reference
    return impl(x, weights, ids, w1, w3, w2, limit, touched, remote)


def moe_experts_triton(x, weights, ids, w1, w3, w2, limit, **launch):
    """[N, D] fp32: the pairs' outputs summed per token (the model sums them in moe_combine instead)."""
    n, dim = x.shape
    pairs = moe_expert_pairs_triton(x, weights, ids, w1, w3, w2, limit, **launch)
    return pairs.view(n, -1, dim).sum(1, dtype=torch.float32)


# The epilogue: the shared expert's SwiGLU, and the sum of each token's picks and the shared expert.


def shared_swiglu_reference(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gate, up [N, I] (the shared expert's w1 and w3 projections, x's dtype) -> swiglu in fp32, in their dtype."""
    return swiglu(wide(gate), wide(up), limit).to(gate.dtype)


@triton.jit
def _swiglu_kernel(
    gate_ptr, up_ptr, out_ptr, stride_g, stride_u, stride_o, limit,
    INTER: tl.constexpr, CLAMP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < INTER
    gate = tl.load(gate_ptr + t * stride_g + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + t * stride_u + i, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    tl.store(out_ptr + t * stride_o + i, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


def shared_swiglu_triton(gate: torch.Tensor, up: torch.Tensor, limit: float, block: int = 1024) -> torch.Tensor:
    """One launch; gate and up may be the two halves of one [N, 2I] projection (row strides of their own)."""
    n, inter = gate.shape
    out = torch.empty(n, inter, dtype=gate.dtype, device=gate.device)
    if n == 0:
        return out
    if gate.stride(1) != 1 or up.stride(1) != 1:
        gate, up = gate.contiguous(), up.contiguous()
    block = min(block, triton.next_power_of_2(inter))
    _swiglu_kernel[(n, triton.cdiv(inter, block))](
        gate, up, out, gate.stride(0), up.stride(0), out.stride(0), limit, INTER=inter, CLAMP=limit > 0, BLOCK=block,
        num_warps=4,
    )  # fmt: skip
    return out


def shared_swiglu(gate, up, limit):
    impl = shared_swiglu_triton if use_triton(gate.device) else shared_swiglu_reference
    return impl(gate, up, limit)


def moe_combine_reference(pairs: torch.Tensor, shared: torch.Tensor, top_k: int) -> torch.Tensor:
    """pairs [N * k, D] (moe_expert_pairs), shared [N, D] -> [N, D] in shared's dtype (x's): each token's k pick
    rows summed in fp32, plus the shared expert, rounded once."""
    n, dim = shared.shape
    routed = wide(pairs.view(n, top_k, dim)).sum(1)
    return (routed + wide(shared)).to(shared.dtype)


@triton.jit
def _combine_kernel(
    pairs_ptr, shared_ptr, out_ptr, stride_p, stride_s, stride_o,
    D: tl.constexpr, TOP_K: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """out[t] = ((y[t, 0] + y[t, 1]) + ... + y[t, k - 1]) + shared[t], in fp32 and in that order (deterministic)."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = d < D
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + j) * stride_p + d, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(shared_ptr + t * stride_s + d, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + d, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine_triton(pairs: torch.Tensor, shared: torch.Tensor, top_k: int, block_d: int = 1024) -> torch.Tensor:
    n, dim = shared.shape
    out = torch.empty(n, dim, dtype=shared.dtype, device=shared.device)
    if n == 0:
        return out
    if pairs.stride(1) != 1 or shared.stride(1) != 1:
        pairs, shared = pairs.contiguous(), shared.contiguous()
    block_d = min(block_d, triton.next_power_of_2(dim))
    _combine_kernel[(n, triton.cdiv(dim, block_d))](
        pairs, shared, out, pairs.stride(0), shared.stride(0), out.stride(0), D=dim, TOP_K=top_k, BLOCK_D=block_d,
        num_warps=4,
    )  # fmt: skip
    return out


def moe_combine(pairs, shared, top_k):
    impl = moe_combine_triton if use_triton(shared.device) else moe_combine_reference
    return impl(pairs, shared, top_k)
