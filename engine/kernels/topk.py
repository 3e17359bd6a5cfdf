"""Top-k c4 rows per request (k = index_topk, 512 for V4-Flash), bounded by each request's real c4 length, emitted
as physical row slots through the page table (reference §5.3, §14.1).

When c4_len <= k every valid row is selected directly. Otherwise the Triton path is an exact radix select on the
order-preserving 32-bit key of each fp32 logit: four rounds of 8 bits (histogram + threshold choice) find
the k-th largest key T; a last pass writes every row with key > T and as many rows with key == T as are still
needed. Every launch has a fixed grid (CUDA-graph safe) and reads only rows < c4_len.

The output order is unspecified (attention does not depend on it); among rows tied with the k-th largest logit the
reference keeps the lower row ids and the kernel keeps any of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import splits_for, use_triton

ROWS_PER_PAGE = 64
# (shift, bits) of each radix round, high bits first. 256 bins keep the histogram atomics per program few.
NUM_BINS = 256
ROUNDS = ((24, 8), (16, 8), (8, 8), (0, 8))
BLOCK = 2048


def topk_slots_reference(
    logits: torch.Tensor, c4_len: torch.Tensor, page_table: torch.Tensor, k: int, out: torch.Tensor
) -> torch.Tensor:
    """logits [B, >= max c4_len] fp32; c4_len [B] int32; page_table [B, max_pages] int32; out [B, k] int32."""
    out.fill_(-1)
    for b in range(logits.shape[0]):
        n = int(c4_len[b])
        if n <= k:
            rows = torch.arange(n, device=logits.device)
        else:
            rows = torch.sort(logits[b, :n], descending=True, stable=True).indices[:k]
        slots = page_table[b, rows // ROWS_PER_PAGE].long() * ROWS_PER_PAGE + rows % ROWS_PER_PAGE
        out[b, : len(rows)] = slots.to(out.dtype)
    return out


@dataclass
class TopKWorkspace:
    """Per-batch scratch, allocated once (a CUDA graph replays with the same buffers). `hist` is all zeros between
    calls: each round's selection clears what it read."""

    hist: torch.Tensor
    prefix: torch.Tensor
    remaining: torch.Tensor
    counters: torch.Tensor

    @classmethod
    def allocate(cls, batch: int, device: torch.device) -> TopKWorkspace:
        zeros = dict(device=device, dtype=torch.int32)
        return cls(
            hist=torch.zeros(batch, NUM_BINS, **zeros),
            prefix=torch.zeros(batch, **zeros),
            remaining=torch.zeros(batch, **zeros),
            counters=torch.zeros(batch, 2, **zeros),
        )


@triton.jit
def _order_key(x):
    """fp32 -> uint32 whose unsigned order is the float order."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)


@triton.jit
def _topk_hist_kernel(
    logits_ptr, len_ptr, prefix_ptr, hist_ptr, stride_lb,
    K: tl.constexpr, SHIFT: tl.constexpr, MATCH_SHIFT: tl.constexpr, FIRST: tl.constexpr,
    SPLITS: tl.constexpr, BLOCK: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(len_ptr + b)
    if n > K:
        prefix = tl.load(prefix_ptr + b).to(tl.uint32, bitcast=True)
        offs = tl.arange(0, BLOCK)
        counts = tl.zeros([NUM_BINS], dtype=tl.int32)
        for start in range(split * BLOCK, n, SPLITS * BLOCK):
            rows = start + offs
            valid = rows < n
            key = _order_key(tl.load(logits_ptr + b * stride_lb + rows, mask=valid, other=0.0))
            if not FIRST:
                valid = valid & ((key >> MATCH_SHIFT) == prefix)
            bins = ((key >> SHIFT) & (NUM_BINS - 1)).to(tl.int32)
            counts += tl.histogram(bins, NUM_BINS, mask=valid)
        tl.atomic_add(hist_ptr + b * NUM_BINS + tl.arange(0, NUM_BINS), counts)


@triton.jit
def _topk_select_kernel(
    len_ptr, hist_ptr, prefix_ptr, remaining_ptr, counters_ptr,
    K: tl.constexpr, BITS: tl.constexpr, FIRST: tl.constexpr, NUM_BINS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    n = tl.load(len_ptr + b)
    if n > K:
        if FIRST:
            need = K
            prefix = 0
            tl.store(counters_ptr + 2 * b + tl.arange(0, 2), tl.zeros([2], dtype=tl.int32))
        else:
            need = tl.load(remaining_ptr + b)
            prefix = tl.load(prefix_ptr + b)
        i = tl.arange(0, NUM_BINS)
        row = hist_ptr + b * NUM_BINS + (NUM_BINS - 1 - i)
        from_top = tl.load(row)  # counts, highest bin first
        cum = tl.cumsum(from_top, axis=0)
        pick = tl.sum((cum < need).to(tl.int32), axis=0)  # first position whose cumulative count reaches `need`
        above = tl.sum(tl.where(i == pick, cum - from_top, 0), axis=0)
        # Cleared through the pointers it was read through: each thread zeroes only the bins it loaded. (Zeroing bin
        # i while bin 255 - i was read raced across warps, since nothing orders one warp's global store before
        # another's load: on the H200 a block of 900 prefill queries got selections short of k.)
        tl.store(row, tl.zeros([NUM_BINS], dtype=tl.int32))
        tl.store(prefix_ptr + b, (prefix << BITS) | (NUM_BINS - 1 - pick))
        tl.store(remaining_ptr + b, need - above)


@triton.jit
def _topk_write_kernel(
    logits_ptr, len_ptr, prefix_ptr, remaining_ptr, counters_ptr, pt_ptr, out_ptr,
    stride_lb, stride_ptb, stride_ob,
    K: tl.constexpr, ROWS: tl.constexpr, SPLITS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    split = tl.program_id(1)
    n = tl.load(len_ptr + b)
    offs = tl.arange(0, BLOCK)
    if n <= K:  # every valid row, then -1
        for start in range(split * BLOCK, K, SPLITS * BLOCK):
            rows = start + offs
            page = tl.load(pt_ptr + b * stride_ptb + rows // ROWS, mask=rows < n, other=0)
            slot = tl.where(rows < n, page * ROWS + rows % ROWS, -1)
            tl.store(out_ptr + b * stride_ob + rows, slot, mask=rows < K)
    else:
        threshold = tl.load(prefix_ptr + b).to(tl.uint32, bitcast=True)
        ties_needed = tl.load(remaining_ptr + b)
        first_tie = K - ties_needed
        for start in range(split * BLOCK, n, SPLITS * BLOCK):
            rows = start + offs
            valid = rows < n
            key = _order_key(tl.load(logits_ptr + b * stride_lb + rows, mask=valid, other=0.0))
            above = valid & (key > threshold)
            tie = valid & (key == threshold)
            base = tl.atomic_add(counters_ptr + 2 * b, tl.sum(above.to(tl.int32), axis=0))
            pos_above = base + tl.cumsum(above.to(tl.int32), axis=0) - 1
            base_tie = tl.atomic_add(counters_ptr + 2 * b + 1, tl.sum(tie.to(tl.int32), axis=0))
            pos_tie = base_tie + tl.cumsum(tie.to(tl.int32), axis=0) - 1
            tie = tie & (pos_tie < ties_needed)
            page = tl.load(pt_ptr + b * stride_ptb + rows // ROWS, mask=above | tie, other=0)
            slot = page * ROWS + rows % ROWS
            tl.store(out_ptr + b * stride_ob + pos_above, slot, mask=above)
            tl.store(out_ptr + b * stride_ob + first_tie + pos_tie, slot, mask=tie)


def topk_slots_triton(logits, c4_len, page_table, k, out, workspace: TopKWorkspace | None = None,
                      splits: int | None = None):  # fmt: skip
    batch = logits.shape[0]
    splits = splits or splits_for(batch, logits.device, waves=1, cap=128)
    ws = workspace or TopKWorkspace.allocate(batch, logits.device)
    match_shift = 32
    for round_no, (shift, bits) in enumerate(ROUNDS):
        first = round_no == 0
        _topk_hist_kernel[(batch, splits)](
            logits, c4_len, ws.prefix, ws.hist, logits.stride(0),
            K=k, SHIFT=shift, MATCH_SHIFT=match_shift, FIRST=first, SPLITS=splits, BLOCK=BLOCK, NUM_BINS=NUM_BINS,
        )  # fmt: skip
        _topk_select_kernel[(batch,)](
            c4_len, ws.hist, ws.prefix, ws.remaining, ws.counters, K=k, BITS=bits, FIRST=first, NUM_BINS=NUM_BINS
        )
        match_shift = shift
    _topk_write_kernel[(batch, splits)](
        logits, c4_len, ws.prefix, ws.remaining, ws.counters, page_table, out,
        logits.stride(0), page_table.stride(0), out.stride(0),
        K=k, ROWS=ROWS_PER_PAGE, SPLITS=splits, BLOCK=BLOCK,
    )  # fmt: skip
    return out


def topk_slots(logits, c4_len, page_table, k, out, workspace: TopKWorkspace | None = None):
    if use_triton(logits.device):
        return topk_slots_triton(logits, c4_len, page_table, k, out, workspace)
    return topk_slots_reference(logits, c4_len, page_table, k, out)
