"""Lightning-indexer logits over paged c4 index keys (reference §5.3, §14.1).

logits[b, r] = scale_r * sum_h w[b, h] * ReLU(q[b, h] . k_r) for every c4 row r < c4_len[b]; rows past c4_len are not
written (top-k never reads them). Keys live in pages of 64 rows: row r of request b is physical row
page_table[b, r // 64] * 64 + r % 64. FP8 keys carry one fp32 scale per row (block-major page: 64 x 128 e4m3 values,
then 64 scales); bf16 keys have none.

The Triton kernel runs on a fixed grid (batch, splits) that does not change between CUDA-graph replays; each program
walks its contiguous share of the request's pages up to c4_len only, so the work follows the actual length, never
the configured maximum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, splits_for, use_triton
from engine.kernels.scales import pow2_ceil

ROWS_PER_PAGE = 64


def indexer_logits_reference(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    key_scales: torch.Tensor | None,
    page_table: torch.Tensor,
    c4_len: torch.Tensor,
    out: torch.Tensor,
) -> torch.Tensor:
    """q [B, H, D]; weights [B, H] fp32; keys [pages, 64, D] (`kv_format.index_values` of index-key storage);
    key_scales [pages, 64] fp32 or None; page_table [B, max_pages] int32; c4_len [B] int32; out [B, max_pages * 64]
    fp32."""
    for b in range(q.shape[0]):
        n = int(c4_len[b])
        if n == 0:
            continue
        rows = torch.arange(n, device=q.device)
        page, row = page_table[b, rows // ROWS_PER_PAGE].long(), rows % ROWS_PER_PAGE
        scores = torch.relu(q[b].float() @ keys[page, row].float().T)  # [H, n]
        logits = (weights[b, :, None] * scores).sum(0)
        if key_scales is not None:
            logits = logits * key_scales[page, row]
        out[b, :n] = logits
    return out


@triton.jit
def _indexer_logits_kernel(
    q_ptr, w_ptr, k_ptr, ks_ptr, pt_ptr, len_ptr, out_ptr,
    stride_qb, stride_qh, stride_wb, stride_kp, stride_sp, stride_ptb, stride_ob,
    H: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, HAS_SCALE: tl.constexpr,
    F32_DOT: tl.constexpr, FP8_DOT: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(len_ptr + b)
    # Split s takes a contiguous run of the request's pages: its loads stream, and the run is empty past the length.
    n_pages = tl.cdiv(n, ROWS)
    per_split = tl.cdiv(n_pages, SPLITS)
    first = split * per_split
    last = tl.minimum(first + per_split, n_pages)
    pt_row = pt_ptr + b * stride_ptb
    r = tl.arange(0, ROWS)
    # A page's 64 x D keys are one contiguous block (a per-row gathered address cost half the bandwidth on an H200).
    block = r[:, None] * D + tl.arange(0, D)[None, :]
    # The page id rides one step ahead in registers: a step's key load then waits on no load of its own step, and
    # the pipeliner keeps STAGES - 1 pages in flight (with the id loaded beside its keys it waited for every copy at
    # each step: 55% of the copy bandwidth at batch 16 against 66%). The first id is asked for before the queries.
    page = tl.load(pt_row + first + 0 * r, mask=first < last, other=0)
    h = tl.arange(0, H)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b * stride_qb + h[:, None] * stride_qh + d[None, :])
    w = tl.load(w_ptr + b * stride_wb + h)
    if FP8_DOT:
        # FP8 keys meet FP8 queries on the tensor cores: each head's query is scaled by a power of two into e4m3
        # range (exact for the FP4-rounded queries of quant_sim) and the scale moves into the head weight, which
        # ReLU allows since the scale is positive.
        amax = tl.max(tl.abs(q.to(tl.float32)), axis=1)
        q_scale = tl.where(amax > 0, pow2_ceil(amax / 448.0), 1.0)
        q = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
        w = w * q_scale
    q_t = tl.trans(q)
    for p in tl.range(first, last, num_stages=STAGES):
        page_next = tl.load(pt_row + p + 1 + 0 * r, mask=p + 1 < last, other=0)
        k = tl.load(k_ptr + page[:, None].to(tl.int64) * stride_kp + block)
        if F32_DOT:
            s = tl.dot(k.to(tl.float32), q_t.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(k.to(q.dtype), q_t)
        logits = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
        if HAS_SCALE:
            logits = logits * tl.load(ks_ptr + page.to(tl.int64) * stride_sp + r)
        row = p * ROWS + r
        tl.store(out_ptr + b * stride_ob + row, logits, mask=row < n)
        page = page_next


def indexer_logits_triton(
    q, weights, keys, key_scales, page_table, c4_len, out, splits: int | None = None, num_warps: int = 4,
    num_stages: int = 4,
):  # fmt: skip
    batch, heads, dim = q.shape
    # 5 waves of programs: each request's pages spread over the whole GPU even at batch 16 (bench/kernels.py).
    splits = splits or splits_for(batch, q.device, waves=5)
    if keys.dtype == torch.float8_e4m3fn and q.dtype == torch.float32:
        raise ValueError("fp8 keys need bf16 queries")
    if keys.stride(2) != 1 or keys.stride(1) != dim:
        raise ValueError("each page's keys must be one contiguous [64, dim] block")
    _indexer_logits_kernel[(batch, splits)](
        q, weights, keys, key_scales if key_scales is not None else weights, page_table, c4_len, out,
        q.stride(0), q.stride(1), weights.stride(0), keys.stride(0),
        key_scales.stride(0) if key_scales is not None else 0, page_table.stride(0), out.stride(0),
        H=heads, D=dim, ROWS=ROWS_PER_PAGE, SPLITS=splits, HAS_SCALE=key_scales is not None,
        F32_DOT=q.dtype == torch.float32 or interpreting(),
        FP8_DOT=keys.dtype == torch.float8_e4m3fn and not interpreting(), STAGES=num_stages, num_warps=num_warps,
    )  # fmt: skip
    return out


def indexer_logits(q, weights, keys, key_scales, page_table, c4_len, out):
    impl = indexer_logits_triton if use_triton(q.device) else indexer_logits_reference
    return impl(q, weights, keys, key_scales, page_table, c4_len, out)
