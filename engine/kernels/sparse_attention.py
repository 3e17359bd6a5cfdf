"""Sparse decode attention with an attention sink (reference §5.4, §14.2): one query token per request attends to
its sliding-window rows (a ring of `window` rows in page `seq_slot`) and to a list of compressed rows (the indexer's
top-k for c4 layers, every visible row for c128 layers), keys being the values:

    o_h = sum_j exp(s_hj) kv_j / (sum_j exp(s_hj) + exp(sink_h)),   s_hj = scale * q_h . kv_j

Rows are bf16, or the 584-byte fp8 rows of `engine/kernels/kv_format.py`. The Triton kernel splits each request's
key list across programs (split-K) and merges the partial results by log-sum-exp, the sink joining in the merge;
index blocks past the request's real list length are skipped, so work follows the actual length.

Prefill runs the same kernel with each query token as a batch row (`window_span`): its window rows then come from a
contiguous span of rows in the ring's format (pages of `window` rows) that holds the window - 1 rows before the chunk
and the chunk's own, since the ring keeps only the last `window` positions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, shared_memory_limit, splits_for, use_triton, wide
from engine.kernels.kv_format import MAIN_SCALE_BYTES, read_main_rows

LOG2E = tl.constexpr(1.4426950408889634)  # scores in log2 units: the softmax is exp2
# An fp8 row's scale bytes, which the kernel loads as one int64: there must be 8.
assert MAIN_SCALE_BYTES == 8
SCALE_BYTES = tl.constexpr(MAIN_SCALE_BYTES)

Launch = tuple[int, int, int, int]  # head_block, block_n, num_warps, num_stages
# Up to this batch, 16-head blocks: four times the programs, each with a quarter of the accumulator. On the H200,
# fp8 rows: 14.0-14.4 vs 17.0-17.8 us at batch 1-3, but 20.2 vs 17.7 at batch 4 (a graph pads 3 requests to 4).
FEW_REQUESTS = 2
# Launches by (fp8 rows, few requests), fastest first; a GPU gets the first whose kernel fits its shared memory a
# block. The first of each is `bench/kernels.py --sweep`'s choice on an H200 (227 KB a block). Many requests: fp8
# rows copy two blocks ahead (208 KB; 47.1 vs 47.9 us with one), bf16 rows' copies are twice the size (3 stages would
# need 256 KB). Batch 1: 13.9 / 12.0 us (fp8 / bf16) against 17.7 / 17.2 us with the 64-head launch. Ada and consumer
# Blackwell GPUs (sm_89, sm_120) have 99 KB, where the 64-head launches would need 273 KB / 136 KB: the last fit
# there (80 KB / 66 KB; tests/engine/test_attention_shared_memory.py compiles them for those targets). On the H200's
# bench case they take 106 / 54 us (fp8 / bf16); fp8 with 2 stages (101 us there) would need 100.25 KB.
LAUNCHES: dict[tuple[bool, bool], tuple[Launch, ...]] = {
    (True, False): ((64, 64, 8, 3), (16, 32, 4, 1)),
    (False, False): ((64, 64, 8, 2), (32, 32, 4, 2)),
    (True, True): ((16, 64, 4, 2), (16, 32, 4, 1)),
    (False, True): ((16, 64, 4, 2), (16, 32, 4, 2)),
}
_fitting: dict[tuple, Launch] = {}  # the launch each (device, row kind, shape, few requests or not) got


def first_fitting(launches: tuple[Launch, ...], shared_bytes: Callable[[Launch], int], limit: int) -> Launch:
    """The first of `launches` whose kernel needs at most `limit` bytes of shared memory."""
    for launch in launches:
        if shared_bytes(launch) <= limit:
            return launch
    raise RuntimeError(f"no sparse-attention launch fits the GPU's {limit} bytes of shared memory a block")


def default_splits(batch: int, heads: int, rows: int, device: torch.device) -> int:
    """Programs per request for keys of at most `rows` rows: enough to fill the GPU once, never more than the request's
    64-row blocks, and those spread evenly (10 blocks take as long over 8 programs as over 5, and 5 merge faster)."""
    blocks = triton.cdiv(rows, 64)
    most = splits_for(batch * triton.cdiv(heads, 64), device, waves=1, cap=min(16, blocks))
    return triton.cdiv(blocks, triton.cdiv(blocks, most))


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
    # The max only keeps exp in range and cancels in the softmax: taken from detached scores, the in-place exp below
    # does not overwrite what a backward pass (the demo model's training) needs.
    m = torch.maximum(s.detach().amax(dim=-1), sink.detach()[None, :])
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
    """q [B, H, D]; sink [H] fp32; window_rows: main-row storage (kv_format.py) with `window` rows a page, request
    b's ring in page seq_slot[b] (row = position % window); positions [B] int32 (the query's); comp_rows: main-row
    storage with
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
def _block_slots(blk, b, t, ring_page, win_len, clen, cslots_ptr, stride_cb, W: tl.constexpr, BN: tl.constexpr,
                 WINDOW_SPAN: tl.constexpr):  # fmt: skip
    """Slots of block blk of request b's keys (-1 = none): the window's blocks first (ring rows, newest first, or
    the prefill span's rows up to the query's own), then the compressed-row list's."""
    idx = blk * BN + tl.arange(0, BN)
    c = idx - W
    listed = tl.load(cslots_ptr + b * stride_cb + c, mask=(c >= 0) & (c < clen), other=-1)
    if WINDOW_SPAN:
        in_ring = ring_page - idx
    else:
        in_ring = ring_page * W + (t - idx + W) % W
    return tl.where(blk < W // BN, tl.where(idx < win_len, in_ring, -1), listed)


@triton.jit
def _load_keys(
    base, slot, rows_per_page, D: tl.constexpr, NOPE: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr
):
    """Rows at `slot` as one [BN, D] tile in the MMA's type, zeros where slot < 0 (nothing read). FP8 rows: the 64-wide
    e4m3 blocks times their power-of-two scales, the bf16 RoPE part in the last 64 columns, where the query has it."""
    valid = slot >= 0
    if FP8:
        NB: tl.constexpr = D // 64
        blk = tl.arange(0, NB)
        e = tl.arange(0, 64)
        is_nope = (blk < NOPE // 64)[None, :]
        data_bytes = NOPE + 2 * (D - NOPE)
        page_base = (slot // rows_per_page).to(tl.int64) * rows_per_page * (data_bytes + SCALE_BYTES)
        row = slot % rows_per_page
        data = tl.multiple_of(page_base + row * data_bytes, 16)  # rows start 16-byte aligned: vector copies
        raw = tl.load(base + data[:, None, None] + (blk[:, None] * 64 + e[None, :])[None, :, :],
                      mask=(valid[:, None] & is_nope)[:, :, None], other=0)  # fmt: skip
        # a row's 8 scale bytes (the last is padding) as one int64: an 8-byte copy that the pipeliner issues ahead
        scale_at = (base + page_base + rows_per_page * data_bytes + row * SCALE_BYTES).to(
            tl.pointer_type(tl.int64), bitcast=True
        )
        exps = (tl.load(scale_at, mask=valid, other=0)[:, None] >> (blk * 8).to(tl.int64)[None, :]) & 0xFF
        rope = tl.load((base + data + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)[:, None] + e[None, :],
                       mask=valid[:, None], other=0.0)  # fmt: skip
        nope = raw.to(tl.float8e4nv, bitcast=True).to(tl.float32) * tl.exp2(exps.to(tl.float32) - 127.0)[:, :, None]
        keys = tl.reshape(tl.where(is_nope[:, :, None], nope, rope.to(tl.float32)[:, None, :]), (slot.shape[0], D))
    else:
        keys = tl.load(base + slot.to(tl.int64)[:, None] * D + tl.arange(0, D)[None, :], mask=valid[:, None], other=0.0)
    return keys.to(tl.float32 if F32_DOT else tl.bfloat16)


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))


@triton.jit
def _sparse_attention_kernel(
    q_ptr, win_ptr, comp_ptr, seq_slot_ptr, pos_ptr, cslots_ptr, clen_ptr, o_part_ptr, lse_part_ptr, sink_ptr, out_ptr,
    stride_qb, stride_qh, stride_cb, stride_ob, stride_oh, scale_log2,
    H: tl.constexpr, HB: tl.constexpr, D: tl.constexpr, NOPE: tl.constexpr, W: tl.constexpr,
    R_COMP: tl.constexpr, BN: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr, F32_DOT: tl.constexpr,
    WINDOW_SPAN: tl.constexpr,
):  # fmt: skip
    """One loop over the blocks of a request's keys, window and list alike, so that the pipeliner copies a block's
    rows while the previous one is in the MMAs; each block's slots are loaded one step ahead. Scores in log2 units
    (scale_log2 = scale * log2 e), so the softmax is exp2."""
    b = tl.program_id(0)
    hb = tl.program_id(1)
    split = tl.program_id(2)
    t = tl.load(pos_ptr + b)
    ring_page = tl.load(seq_slot_ptr + b)
    win_len = tl.minimum(t + 1, W)
    clen = tl.load(clen_ptr + b)
    n_blocks = W // BN + tl.cdiv(clen, BN)  # list blocks past the real length are never visited
    heads = hb * HB + tl.arange(0, HB)
    head_ok = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_ok[:, None], other=0.0)
    m = tl.full([HB], float("-inf"), tl.float32)
    denom = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, D], tl.float32)
    next_slot = _block_slots(split, b, t, ring_page, win_len, clen, cslots_ptr, stride_cb, W, BN, WINDOW_SPAN)
    for blk in range(split, n_blocks, SPLITS):
        slot = next_slot
        next_slot = _block_slots(blk + SPLITS, b, t, ring_page, win_len, clen, cslots_ptr, stride_cb, W, BN,
                                 WINDOW_SPAN)  # fmt: skip
        in_window = blk < W // BN
        keys = _load_keys(tl.where(in_window, win_ptr, comp_ptr), slot, tl.where(in_window, W, R_COMP), D, NOPE,
                          FP8, F32_DOT)  # fmt: skip
        s = tl.where(slot[None, :] >= 0, _dot(q, tl.trans(keys), F32_DOT) * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m - m_safe)
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p, keys, F32_DOT)
        m = m_new
    if SPLITS == 1:  # the whole list in one program: merge the sink here and write the output directly
        sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0) * LOG2E
        top = tl.maximum(m, sink)
        keep = tl.exp2(m - top)
        inv = keep / (denom * keep + tl.exp2(sink - top))
        out_row = out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(out_row, (acc * inv[:, None]).to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
        return
    has = denom > 0
    inv = 1.0 / tl.where(has, denom, 1.0)
    lse = tl.where(has, (m + tl.log2(tl.where(has, denom, 1.0))) / LOG2E, float("-inf"))  # natural log
    part = (b * SPLITS + split) * H + heads
    tl.store(o_part_ptr + part[:, None] * D + d[None, :], acc * inv[:, None], mask=head_ok[:, None])
    tl.store(lse_part_ptr + part, lse, mask=head_ok)


@triton.jit
def _merge_splits_kernel(
    o_part_ptr, lse_part_ptr, sink_ptr, out_ptr, stride_ob, stride_oh,
    H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr,
):  # fmt: skip
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
    window, rope_dim, window_span: bool = False, splits: int | None = None, launch: Launch | None = None,
):  # fmt: skip
    """`launch` overrides the pick from LAUNCHES (as `bench/kernels.py --sweep` does)."""
    batch, heads, dim = q.shape
    fp8 = window_rows.dtype == torch.uint8
    if fp8 and (rope_dim != 64 or dim & (dim - 1) or dim < 128):
        raise ValueError(f"fp8 rows need a 64-wide RoPE part and a power-of-two head dim >= 128, not {rope_dim}/{dim}")
    if not fp8 and dim & (dim - 1):
        raise ValueError(f"head dim {dim} must be a power of two")
    splits = splits or default_splits(batch, heads, window + comp_slots.shape[1], q.device)
    o_part = torch.empty(batch, splits, heads, dim, device=q.device, dtype=torch.float32) if splits > 1 else out
    lse_part = torch.empty(batch, splits, heads, device=q.device, dtype=torch.float32) if splits > 1 else sink

    def run(launch: Launch, warmup: bool = False):
        head_block, block_n, num_warps, num_stages = launch
        head_block = min(head_block, max(16, triton.next_power_of_2(heads)))
        block_n = min(block_n, window)  # window blocks must not straddle into the compressed rows
        if window % block_n:
            raise ValueError(f"window {window} must be a multiple of {block_n}")
        grid = (batch, triton.cdiv(heads, head_block), splits)
        args = (
            q, window_rows, comp_rows, seq_slot, positions, comp_slots, comp_len, o_part, lse_part, sink, out,
            q.stride(0), q.stride(1), comp_slots.stride(0), out.stride(0), out.stride(1), scale * LOG2E.value,
        )  # fmt: skip
        consts = dict(H=heads, HB=head_block, D=dim, NOPE=dim - rope_dim, W=window, R_COMP=comp_rows_per_page,
                      BN=block_n, SPLITS=splits, FP8=fp8, F32_DOT=q.dtype == torch.float32 or interpreting(),
                      WINDOW_SPAN=window_span, num_warps=num_warps, num_stages=num_stages)  # fmt: skip
        if warmup:
            return _sparse_attention_kernel.warmup(*args, grid=grid, **consts)
        return _sparse_attention_kernel[grid](*args, **consts)

    if launch is None:
        few = batch <= FEW_REQUESTS
        launches = LAUNCHES[fp8, few]
        key = (q.device, fp8, q.dtype, heads, dim, rope_dim, window, window_span, splits > 1, few)
        if key not in _fitting and interpreting():  # the interpreter has no shared memory
            _fitting[key] = launches[0]
        if key not in _fitting:  # compiles (no launch) until one fits; later calls launch at once

            def shared_bytes(launch: Launch) -> int:
                return run(launch, warmup=True).metadata.shared

            _fitting[key] = first_fitting(launches, shared_bytes, shared_memory_limit(q.device))
        launch = _fitting[key]
    run(launch)
    if splits > 1:
        _merge_splits_kernel[(batch, heads)](
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
