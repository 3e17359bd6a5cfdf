"""Sparse decode attention with an attention sink (reference §5.4, §14.2): one query token per request attends to
its sliding-window rows (a ring of `window` rows in page `seq_slot`) and to a list of compressed rows (the indexer's
top-k for c4 layers, every visible row for c128 layers), keys being the values:

    o_h = sum_j exp(s_hj) kv_j / (sum_j exp(s_hj) + exp(sink_h)),   s_hj = scale * q_h . kv_j

Rows are bf16, or the 584-byte fp8 rows of `engine/cache/kv_cache.py`. The Triton kernel splits each request's
key list across programs (split-K) and merges the partial results by log-sum-exp, the sink joining in the merge;
index blocks past the request's real list length are skipped, so work follows the actual length.

Prefill runs the same kernel with each query token as a batch row (`window_span`): its window rows then come from a
contiguous span of rows in the ring's format (pages of `window` rows) that holds the window - 1 rows before the chunk
and the chunk's own, since the ring keeps only the last `window` positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.cache.kv_cache import SCALE_BYTES, read_main_rows
from engine.kernels.dispatch import interpreting, splits_for, use_triton, wide

BLOCK_N = 64  # launch defaults from `bench/kernels.py --sweep` on an H200 (bench/results/kernels.md)


def attend_with_sink(
    q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """The formula on dense inputs: q [T, H, D], keys [L, D], allowed [T, L] bool, sink [H] -> [T, H, D] fp32."""
    return attend_parts_with_sink(q, [(keys, allowed)], sink, scale)


def attend_parts_with_sink(
    q: torch.Tensor, parts: list[tuple[torch.Tensor, torch.Tensor]], sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """The formula over keys given in parts, one softmax across them all: q [T, H, D]; each part (keys, allowed),
    keys [L, D] shared by every query or [T, L, D] a set per query, allowed [T, L] bool; sink [H] -> [T, H, D] fp32.
    Per-query parts let each query bring only its own rows (window, top-k) instead of masking their union."""
    q = wide(q)
    s = torch.cat([torch.einsum("thd,ld->thl" if k.dim() == 2 else "thd,tld->thl", q, k.to(q.dtype)) for k, _ in parts],
                  -1)  # fmt: skip
    s = (s * scale).masked_fill_(~torch.cat([a for _, a in parts], dim=-1)[:, None, :], float("-inf"))
    m = torch.maximum(s.amax(dim=-1), sink[None, :])
    p = s.sub_(m[..., None]).exp_()
    denom = p.sum(dim=-1) + torch.exp(sink[None, :] - m)
    out = torch.zeros_like(q)
    for pk, (k, _) in zip(p.split([k.shape[-2] for k, _ in parts], dim=-1), parts, strict=True):
        out += torch.einsum("thl,ld->thd" if k.dim() == 2 else "thl,tld->thd", pk, k.to(q.dtype))
    return out / denom[..., None]


def sparse_decode_attention_reference(
    q: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    window_rows: torch.Tensor,
    seq_slot: torch.Tensor,
    positions: torch.Tensor,
    comp_rows: torch.Tensor,
    comp_rows_per_page: int,
    comp_slots: torch.Tensor,
    comp_len: torch.Tensor,
    out: torch.Tensor,
    window: int,
    rope_dim: int,
    window_span: bool = False,
) -> torch.Tensor:
    """q [B, H, D]; sink [H] fp32; window_rows: `MainRows.storage` with `window` rows a page, request b's ring in
    page seq_slot[b] (row = position % window); positions [B] int32 (the query's); comp_rows: `MainRows.storage` with
    `comp_rows_per_page` rows a page; comp_slots [B, K] int32 physical slots (-1 = none), the first comp_len[b]
    meaningful; out [B, H, D]. With `window_span`, window_rows is a span of rows and seq_slot[b] the row of query b's
    own position in it: its window is the min(position + 1, window) rows up to that one."""
    head_dim = q.shape[-1]
    for b in range(q.shape[0]):
        t = int(positions[b])
        back = torch.arange(min(t + 1, window), device=q.device)
        ring = int(seq_slot[b]) - back if window_span else (t - back) % window + int(seq_slot[b]) * window
        keys = [read_main_rows(window_rows, ring, window, head_dim, rope_dim)]
        picked = comp_slots[b, : int(comp_len[b])]
        picked = picked[picked >= 0]
        if len(picked):
            keys.append(read_main_rows(comp_rows, picked, comp_rows_per_page, head_dim, rope_dim))
        keys = torch.cat(keys)
        allowed = torch.ones(1, keys.shape[0], dtype=torch.bool, device=q.device)
        out[b] = attend_with_sink(q[b : b + 1], keys, allowed, sink, scale)[0].to(out.dtype)
    return out


@triton.jit
def _load_rows(ptr, page, row, rows_per_page, valid, D: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr):
    """Rows at (page, row) as (nope [BN, NOPE_POW2] fp32, zero past NOPE; rope [BN, D - NOPE] fp32). Invalid rows
    read as zeros without touching memory."""
    NOPE_BLOCKS: tl.constexpr = triton.next_power_of_2(NOPE // 64)
    ROPE: tl.constexpr = D - NOPE
    blk = tl.arange(0, NOPE_BLOCKS)
    e = tl.arange(0, 64)
    r = tl.arange(0, ROPE)
    nope_mask = valid[:, None, None] & (blk < NOPE // 64)[None, :, None]
    if FP8:
        data_bytes = NOPE + 2 * ROPE
        page_base = page.to(tl.int64) * (rows_per_page * (data_bytes + 8))
        data = tl.multiple_of(page_base + row * data_bytes, 16)  # rows start 16-byte aligned: vector loads
        raw = tl.load(ptr + data[:, None, None] + (blk[:, None] * 64 + e[None, :])[None, :, :], mask=nope_mask, other=0)
        scale_at = page_base + rows_per_page * data_bytes + row * 8
        exps = tl.load(
            ptr + scale_at[:, None] + blk[None, :], mask=valid[:, None] & (blk < NOPE // 64)[None, :], other=127
        )
        nope = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.exp2(exps.to(tl.float32) - 127.0)[:, :, None]
        rope_ptr = (ptr + data + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        rope = tl.load(rope_ptr[:, None] + r[None, :], mask=valid[:, None], other=0.0)
    else:
        base = (page.to(tl.int64) * rows_per_page + row) * D
        nope = tl.load(ptr + base[:, None, None] + (blk[:, None] * 64 + e[None, :])[None, :, :], mask=nope_mask,
                       other=0.0)  # fmt: skip
        rope = tl.load(ptr + base[:, None] + NOPE + r[None, :], mask=valid[:, None], other=0.0)
    return tl.reshape(nope.to(tl.float32), (nope.shape[0], NOPE_BLOCKS * 64)), rope.to(tl.float32)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _sparse_attention_kernel(
    q_ptr, win_ptr, comp_ptr, seq_slot_ptr, pos_ptr, cslots_ptr, clen_ptr, o_part_ptr, lse_part_ptr, sink_ptr, out_ptr,
    stride_qb, stride_qh, stride_cb, stride_ob, stride_oh, scale,
    H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, W: tl.constexpr,
    R_COMP: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr,
    WINDOW_SPAN: tl.constexpr,
):  # fmt: skip
    NOPE_PAD: tl.constexpr = triton.next_power_of_2(NOPE // 64) * 64
    ROPE: tl.constexpr = D - NOPE
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    t = tl.load(pos_ptr + b)
    ring_page = tl.load(seq_slot_ptr + b)
    win_len = tl.minimum(t + 1, W)
    clen = tl.load(clen_ptr + b)
    win_blocks = tl.cdiv(win_len, BN)  # window blocks past the filled part are skipped
    n_blocks = W // BN + tl.cdiv(clen, BN)
    heads = hb * HB + tl.arange(0, HB)
    head_ok = (heads < H)[:, None]
    dn = tl.arange(0, NOPE_PAD)
    dr = tl.arange(0, ROPE)
    j = tl.arange(0, BN)
    q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
    q_nope = tl.load(q_row + dn[None, :], mask=head_ok & (dn < NOPE)[None, :], other=0.0)
    q_rope = tl.load(q_row + NOPE + dr[None, :], mask=head_ok, other=0.0)
    m = tl.full([HB], float("-inf"), tl.float32)
    denom = tl.zeros([HB], tl.float32)
    acc_nope = tl.zeros([HB, NOPE_PAD], tl.float32)
    acc_rope = tl.zeros([HB, ROPE], tl.float32)
    for blk in range(split, n_blocks, SPLITS):
        if blk < W // BN:  # a block of the sliding window: from the request's ring, or the prefill's span
            idx = blk * BN + j
            valid = (idx < win_len) & (blk < win_blocks)
            if WINDOW_SPAN:  # prefill: the span rows up to the query's own, row seq_slot[b]
                span_row = ring_page - idx
                k_nope, k_rope = _load_rows(win_ptr, span_row // W, span_row % W, W, valid, D, NOPE, FP8)
            else:
                k_nope, k_rope = _load_rows(win_ptr, ring_page + 0 * j, (t - idx + W) % W, W, valid, D, NOPE, FP8)
        else:  # a block of the compressed-row list
            c = (blk - W // BN) * BN + j
            slot = tl.load(cslots_ptr + b * stride_cb + c, mask=c < clen, other=-1)
            valid = slot >= 0
            k_nope, k_rope = _load_rows(comp_ptr, slot // R_COMP, slot % R_COMP, R_COMP, valid, D, NOPE, FP8)
        s = _dot(q_nope, tl.trans(k_nope), F32_DOT) + _dot(q_rope, tl.trans(k_rope), F32_DOT)
        s = tl.where(valid[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc_nope = acc_nope * alpha[:, None] + _dot(p, k_nope, F32_DOT)
        acc_rope = acc_rope * alpha[:, None] + _dot(p, k_rope, F32_DOT)
        m = m_new
    if SPLITS == 1:  # the whole list in one program: merge the sink here and write the output directly
        sink = tl.load(sink_ptr + heads, mask=heads < H, other=0.0)
        top = tl.maximum(m, sink)
        keep = tl.exp(m - top)
        inv = keep / (denom * keep + tl.exp(sink - top))
        out_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh
        out_ty = out_ptr.dtype.element_ty
        tl.store(out_row + dn[None, :], (acc_nope * inv[:, None]).to(out_ty), mask=head_ok & (dn < NOPE)[None, :])
        tl.store(out_row + NOPE + dr[None, :], (acc_rope * inv[:, None]).to(out_ty), mask=head_ok)
        return
    has = denom > 0
    inv = 1.0 / tl.where(has, denom, 1.0)
    lse = tl.where(has, m + tl.log(tl.where(has, denom, 1.0)), float("-inf"))
    part = (b * SPLITS + split) * H + heads
    tl.store(o_part_ptr + part[:, None] * D + dn[None, :], acc_nope * inv[:, None], mask=head_ok & (dn < NOPE)[None, :])
    tl.store(o_part_ptr + part[:, None] * D + NOPE + dr[None, :], acc_rope * inv[:, None], mask=head_ok)
    tl.store(lse_part_ptr + part, lse, mask=heads < H)


@triton.jit
def _combine_kernel(o_part_ptr, lse_part_ptr, sink_ptr, out_ptr, stride_ob, stride_oh,
                    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr):  # fmt: skip
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, D)
    part = (b * SPLITS + s) * H + h
    lse = tl.load(lse_part_ptr + part, mask=s < SPLITS, other=float("-inf"))
    sink = tl.load(sink_ptr + h)
    top = tl.maximum(tl.max(lse, axis=0), sink)
    total = tl.sum(tl.exp(lse - top), axis=0) + tl.exp(sink - top)  # the sink joins the denominator only
    w = tl.exp(lse - top) / total
    o = tl.sum(
        w[:, None] * tl.load(o_part_ptr + part[:, None] * D + d[None, :], mask=(s < SPLITS)[:, None], other=0.0), axis=0
    )
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, o.to(out_ptr.dtype.element_ty))


def sparse_decode_attention_triton(
    q, sink, scale, window_rows, seq_slot, positions, comp_rows, comp_rows_per_page, comp_slots, comp_len, out,
    window, rope_dim, window_span: bool = False, splits: int | None = None, head_block: int | None = None,
    block_n: int = BLOCK_N, num_warps: int = 8, num_stages: int = 2,
):  # fmt: skip
    batch, heads, dim = q.shape
    head_block = head_block or min(64, max(16, triton.next_power_of_2(heads)))
    splits = splits or splits_for(batch * triton.cdiv(heads, head_block), q.device, waves=1, cap=16)
    o_part = torch.empty(batch, splits, heads, dim, device=q.device, dtype=torch.float32) if splits > 1 else out
    lse_part = torch.empty(batch, splits, heads, device=q.device, dtype=torch.float32) if splits > 1 else sink
    fp8 = window_rows.dtype == torch.uint8
    block_n = min(block_n, window)  # window blocks must not straddle into the compressed rows
    if window % block_n:
        raise ValueError(f"window {window} must be a multiple of {block_n}")
    _sparse_attention_kernel[(batch, triton.cdiv(heads, head_block), splits)](
        q, window_rows, comp_rows, seq_slot, positions, comp_slots, comp_len, o_part, lse_part, sink, out,
        q.stride(0), q.stride(1), comp_slots.stride(0), out.stride(0), out.stride(1), scale,
        H=heads, HB=head_block, D=dim, NOPE=dim - rope_dim, W=window, R_COMP=comp_rows_per_page, BN=block_n,
        SPLITS=splits, FP8=fp8, F32_DOT=q.dtype == torch.float32 or interpreting(), WINDOW_SPAN=window_span,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if splits > 1:
        _combine_kernel[(batch, heads)](
            o_part, lse_part, sink, out, out.stride(0), out.stride(1),
            H=heads, D=dim, SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out


def sparse_decode_attention(
    q, sink, scale, window_rows, seq_slot, positions, comp_rows, comp_rows_per_page, comp_slots, comp_len, out,
    window, rope_dim, window_span: bool = False,
):  # fmt: skip
    impl = sparse_decode_attention_triton if use_triton(q.device) else sparse_decode_attention_reference
    return impl(q, sink, scale, window_rows, seq_slot, positions, comp_rows, comp_rows_per_page, comp_slots,
                comp_len, out, window, rope_dim, window_span)  # fmt: skip


assert SCALE_BYTES == 8  # the kernel's fp8 page arithmetic assumes 8 scale bytes a row
