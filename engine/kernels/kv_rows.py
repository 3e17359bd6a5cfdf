"""Writing main KV rows into FP8 pages (engine/cache/kv_cache.py describes the layout): a page of `rows_per_page`
rows holds their data first, each row the e4m3 codes of its nope channels, then its RoPE channels in bf16, and after
all the rows' data their scales, one ue8m0 byte per 64 nope channels, in `row_bytes - data_bytes` bytes a row.

The decode step writes every layer's new window row through `write_main_rows`: the Triton kernel encodes and stores
all rows in one launch, where the codec in torch takes 27 ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import use_triton
from engine.kernels.quant import FP8_MAX, KV_FP8_BLOCK, _pow2_ceil, exact_ceil_log2
from engine.kernels.scales import pow2

# Scales are taken of at least this amax, so that an all-zero block gets a finite one.
AMAX_FLOOR = 1e-30


def write_main_rows_reference(
    storage: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_page: int, rope_dim: int
) -> None:
    """rows [N, head_dim] -> physical `slots` [N] of FP8 pages `storage` [pages, rows_per_page * row_bytes] uint8."""
    nope = rows.shape[1] - rope_dim
    data_bytes = nope + 2 * rope_dim
    scale_bytes = storage.shape[1] // rows_per_page - data_bytes
    blocks = rows[:, :nope].float().unflatten(-1, (-1, KV_FP8_BLOCK))
    scale = _pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp_min(AMAX_FLOOR) / FP8_MAX)
    codes = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).flatten(1).view(torch.uint8)
    rope = rows[:, nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
    exponents = (torch.log2(scale.squeeze(-1)).round() + 127).to(torch.uint8)
    slots = slots.long()
    page, row = slots // rows_per_page, slots % rows_per_page
    data_at = (row * data_bytes)[:, None] + torch.arange(data_bytes, device=rows.device)
    storage[page[:, None], data_at] = torch.cat([codes, rope], dim=1)
    scales_at = (rows_per_page * data_bytes + row * scale_bytes)[:, None]
    storage[page[:, None], scales_at + torch.arange(exponents.shape[1], device=rows.device)] = exponents


@triton.jit
def _write_main_rows_kernel(
    storage_ptr, slot_ptr, rows_ptr, stride_row, stride_col,
    NOPE: tl.constexpr, ROPE: tl.constexpr, ROWS_PER_PAGE: tl.constexpr, ROW_BYTES: tl.constexpr,
    BLOCK: tl.constexpr, BLOCKS_P2: tl.constexpr, ROPE_P2: tl.constexpr, AMAX_FLOOR: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    DATA_BYTES: tl.constexpr = NOPE + 2 * ROPE
    page = storage_ptr + (slot // ROWS_PER_PAGE) * (ROWS_PER_PAGE * ROW_BYTES)
    r = slot % ROWS_PER_PAGE
    row = rows_ptr + n.to(tl.int64) * stride_row
    # Nope channels: e4m3 codes on a power-of-two scale per block of 64; scaling by it is exact, so multiply by its
    # inverse.
    blk = tl.arange(0, BLOCKS_P2)
    is_nope = blk < NOPE // BLOCK
    channel = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(row + channel * stride_col, mask=is_nope[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), AMAX_FLOOR)
    exponent = exact_ceil_log2(tl.div_rn(amax, 448.0))
    codes = tl.minimum(tl.maximum(x * pow2(-exponent)[:, None], -448.0), 448.0).to(tl.float8e4nv)
    tl.store(page + r * DATA_BYTES + channel, codes.to(tl.uint8, bitcast=True), mask=is_nope[:, None])
    # RoPE channels, bf16, after the codes.
    c = tl.arange(0, ROPE_P2)
    rope = tl.load(row + (NOPE + c) * stride_col, mask=c < ROPE).to(tl.bfloat16)
    rope_at = (page + r * DATA_BYTES + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)
    tl.store(rope_at + c, rope, mask=c < ROPE)
    # The scale's exponent, biased by 127, among the page's scales after all its rows' data.
    tl.store(page + ROWS_PER_PAGE * DATA_BYTES + r * (ROW_BYTES - DATA_BYTES) + blk, (exponent + 127).to(tl.uint8),
             mask=is_nope)  # fmt: skip


def write_main_rows_triton(
    storage: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_page: int, rope_dim: int
) -> None:
    """`write_main_rows_reference` in one launch, a program per row."""
    nope = rows.shape[1] - rope_dim
    _write_main_rows_kernel[(rows.shape[0],)](
        storage, slots.contiguous(), rows, rows.stride(0), rows.stride(1),
        NOPE=nope, ROPE=rope_dim, ROWS_PER_PAGE=rows_per_page, ROW_BYTES=storage.shape[1] // rows_per_page,
        BLOCK=KV_FP8_BLOCK, BLOCKS_P2=triton.next_power_of_2(nope // KV_FP8_BLOCK),
        ROPE_P2=triton.next_power_of_2(rope_dim), AMAX_FLOOR=AMAX_FLOOR,
    )  # fmt: skip


def write_main_rows(
    storage: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_page: int, rope_dim: int
) -> None:
    """Encode rows [N, head_dim] and store them at physical `slots` [N] of FP8 pages: the Triton kernel on CUDA, the
    reference elsewhere."""
    impl = write_main_rows_triton if use_triton(storage.device) else write_main_rows_reference
    impl(storage, slots, rows, rows_per_page, rope_dim)
