"""Writing main KV rows into FP8 pages (engine/kernels/kv_format.py describes the layout): a page of `rows_per_page`
rows holds their data first, each row the e4m3 codes of its nope channels, then its RoPE channels in bf16, and after
all the rows' data their scales, one ue8m0 byte per 64 nope channels, in `row_bytes - data_bytes` bytes a row.

`write_main_rows` encodes and stores rows in one launch, where the codec in torch takes 27 ops. A decode step writes
each layer's new window rows with `write_window_rows`, which also takes the steps before the write: kv_norm, RoPE
and the ring slot of each request's position (seven launches before, one now).

`decode_row_lists` makes, once per step and layer kind, what the sparse attention reads of the compressed rows: the
visible count, the list length and (c128) the list itself, in one launch where torch took two to twelve per layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import use_triton
from engine.kernels.norm import rms_norm_reference
from engine.kernels.quant import FP8_MAX, KV_FP8_BLOCK, _pow2_ceil, exact_ceil_log2, simulate_kv_row_fp8
from engine.kernels.rope import rope_reference
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


# Slots may be a slice of a request's slot list at any offset: a program loads its one slot, alignment buys nothing.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
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


def write_window_rows_reference(
    x: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    storage: torch.Tensor,
    seq_slot: torch.Tensor,
    window: int,
    quant_sim: bool,
) -> None:
    """The decode step's new window rows: x [B, head_dim] (the wkv projection, rows may be strided) -> kv_norm
    (weight, fp32, back in x's dtype) -> RoPE at positions [B] -> ring row positions % window of page seq_slot [B] of
    `storage` (main-row storage of kv_format.py with `window` rows a page). Non-FP8 storage with quant_sim stores the
    nope channels on their FP8 grid, as the FP8 rows would hold them."""
    rope_dim = 2 * inv_freq.shape[0]
    kv = rope_reference(rms_norm_reference(x, norm_weight, eps), positions, inv_freq)
    slots = seq_slot.long() * window + positions.long() % window
    if storage.dtype == torch.uint8:
        write_main_rows_reference(storage, slots, kv, window, rope_dim)
        return
    if quant_sim:
        kv = simulate_kv_row_fp8(kv, rope_dim)
    storage[slots] = kv.to(storage.dtype)


@triton.jit
def _write_window_rows_kernel(
    x_ptr, stride_x, w_ptr, pos_ptr, inv_freq_ptr, slot_ptr, storage_ptr, eps,
    D: tl.constexpr, ROPE: tl.constexpr, W: tl.constexpr, ROW_BYTES: tl.constexpr, BLOCK: tl.constexpr,
    FP8: tl.constexpr, QUANT_SIM: tl.constexpr, AMAX_FLOOR: tl.constexpr,
):  # fmt: skip
    """A program per row: RMSNorm, RoPE, then the FP8 encoding of `_write_main_rows_kernel` (or a plain store)."""
    b = tl.program_id(0)
    pos = tl.load(pos_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64) * W + pos % W
    dtype = x_ptr.dtype.element_ty
    d = tl.arange(0, D)
    x = tl.load(x_ptr + b.to(tl.int64) * stride_x + d).to(tl.float32)
    # kv_norm as rms_norm: fp32, back in x's dtype
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    y = (tl.load(w_ptr + d) * (x * inv_rms)).to(dtype).to(tl.float32)
    # RoPE as the rope kernel: interleaved pairs of the last ROPE channels, rotated in fp32, back in x's dtype
    even, odd = tl.split(tl.reshape(y, (D // 2, 2)))
    pair = tl.arange(0, D // 2)
    is_rope = pair >= (D - ROPE) // 2
    freq = tl.load(inv_freq_ptr + pair - (D - ROPE) // 2, mask=is_rope, other=0.0)
    angle = pos.to(tl.float32) * freq
    cos, sin = tl.cos(angle), tl.sin(angle)
    even2 = tl.where(is_rope, (even * cos - odd * sin).to(dtype).to(tl.float32), even)
    odd2 = tl.where(is_rope, (even * sin + odd * cos).to(dtype).to(tl.float32), odd)
    y = tl.reshape(tl.join(even2, odd2), (D,))
    NOPE: tl.constexpr = D - ROPE
    if FP8 or QUANT_SIM:  # nope channels: e4m3 codes on a power-of-two scale per BLOCK
        blocks = tl.reshape(y, (D // BLOCK, BLOCK))
        blk = tl.arange(0, D // BLOCK)
        is_nope = blk < NOPE // BLOCK
        amax = tl.maximum(tl.max(tl.abs(blocks), axis=1), AMAX_FLOOR)
        exponent = exact_ceil_log2(tl.div_rn(amax, 448.0))
        codes = tl.minimum(tl.maximum(blocks * pow2(-exponent)[:, None], -448.0), 448.0).to(tl.float8e4nv)
    if FP8:
        DATA_BYTES: tl.constexpr = NOPE + 2 * ROPE
        page = storage_ptr + (slot // W) * (W * ROW_BYTES)
        r = slot % W
        channel = blk[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        tl.store(page + r * DATA_BYTES + channel, codes.to(tl.uint8, bitcast=True), mask=is_nope[:, None])
        rope_at = (page + r * DATA_BYTES + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)
        tl.store(rope_at + (d - NOPE), y.to(tl.bfloat16), mask=d >= NOPE)
        tl.store(page + W * DATA_BYTES + r * (ROW_BYTES - DATA_BYTES) + blk, (exponent + 127).to(tl.uint8),
                 mask=is_nope)  # fmt: skip
    else:
        if QUANT_SIM:
            rounded = tl.reshape(codes.to(tl.float32) * pow2(exponent)[:, None], (D,))
            y = tl.where(d < NOPE, rounded, y)
        tl.store(storage_ptr + slot * D + d, y.to(storage_ptr.dtype.element_ty))


def write_window_rows_triton(x, norm_weight, eps, positions, inv_freq, storage, seq_slot, window, quant_sim) -> None:
    """`write_window_rows_reference` in one launch (head_dim a power of two, nope channels a multiple of 64)."""
    dim, rope_dim = x.shape[1], 2 * inv_freq.shape[0]
    assert x.stride(1) == 1 and dim & (dim - 1) == 0 and (dim - rope_dim) % KV_FP8_BLOCK == 0
    fp8 = storage.dtype == torch.uint8
    _write_window_rows_kernel[(x.shape[0],)](
        x, x.stride(0), norm_weight, positions, inv_freq, seq_slot, storage, eps,
        D=dim, ROPE=rope_dim, W=window, ROW_BYTES=storage.shape[1] // window if fp8 else 0, BLOCK=KV_FP8_BLOCK,
        FP8=fp8, QUANT_SIM=quant_sim, AMAX_FLOOR=AMAX_FLOOR if fp8 else torch.finfo(torch.float32).tiny * FP8_MAX,
    )  # fmt: skip


def write_window_rows(x, norm_weight, eps, positions, inv_freq, storage, seq_slot, window, quant_sim) -> None:
    """`write_window_rows_reference`: the Triton kernel on CUDA, the reference elsewhere and for float64."""
    triton_ok = use_triton(x.device) and x.dtype != torch.float64
    impl = write_window_rows_triton if triton_ok else write_window_rows_reference
    impl(x, norm_weight, eps, positions, inv_freq, storage, seq_slot, window, quant_sim)


def decode_row_lists_reference(
    positions: torch.Tensor, page_table: torch.Tensor, ratio: int, rows_per_page: int, limit: int, with_slots: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a decode step's queries at positions [B] (int32) see of a layer kind's compressed rows, shared by every
    layer of that kind: (visible rows [B] int32 = (pos + 1) // ratio, 0 without compression; list length [B] int32 =
    min(visible, limit); slots [B, S] int32). With `with_slots` (c128: every visible row, in order) slot j of request
    b is the physical slot of row j, page_table[b, j // rows_per_page] * rows_per_page + j % rows_per_page, for
    j < visible (-1 past it, which readers never reach); otherwise slots is [B, 1] and never read."""
    batch = positions.shape[0]
    visible = (positions + 1) // ratio if ratio else torch.zeros_like(positions)
    length = visible.clamp(max=limit)
    if not with_slots:
        return visible, length, torch.full((batch, 1), -1, dtype=torch.int32, device=positions.device)
    rows = torch.arange(page_table.shape[1] * rows_per_page, device=positions.device)
    pages = page_table[:, rows // rows_per_page].long()
    slots = torch.where(rows[None, :] < visible[:, None], pages * rows_per_page + rows % rows_per_page, -1).int()
    return visible, length, slots


@triton.jit
def _decode_row_lists_kernel(
    pos_ptr, pt_ptr, visible_ptr, length_ptr, slots_ptr, stride_pt, stride_slots, limit,
    RATIO: tl.constexpr, ROWS_PER_PAGE: tl.constexpr, WITH_SLOTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    if RATIO == 0:
        visible = tl.load(pos_ptr + b) * 0
    else:
        visible = (tl.load(pos_ptr + b) + 1) // RATIO
    tl.store(visible_ptr + b, visible)
    tl.store(length_ptr + b, tl.minimum(visible, limit))
    if WITH_SLOTS:  # only the visible rows: work follows the request's length
        for j0 in range(0, visible, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            live = j < visible
            page = tl.load(pt_ptr + b * stride_pt + j // ROWS_PER_PAGE, mask=live, other=0)
            tl.store(slots_ptr + b * stride_slots + j, page * ROWS_PER_PAGE + j % ROWS_PER_PAGE, mask=live)


def decode_row_lists_triton(positions, page_table, ratio, rows_per_page, limit, with_slots):
    """`decode_row_lists_reference` in one launch; slots past a request's visible rows are left unwritten."""
    batch, device = positions.shape[0], positions.device
    visible = torch.empty(batch, dtype=torch.int32, device=device)
    length = torch.empty(batch, dtype=torch.int32, device=device)
    width = page_table.shape[1] * rows_per_page if with_slots else 1
    slots = torch.empty(batch, width, dtype=torch.int32, device=device)
    _decode_row_lists_kernel[(batch,)](
        positions, page_table, visible, length, slots, page_table.stride(0), slots.stride(0), limit,
        RATIO=ratio, ROWS_PER_PAGE=rows_per_page, WITH_SLOTS=with_slots, BLOCK=1024,
    )  # fmt: skip
    return visible, length, slots


def decode_row_lists(positions, page_table, ratio, rows_per_page, limit, with_slots):
    impl = decode_row_lists_triton if use_triton(positions.device) else decode_row_lists_reference
    return impl(positions, page_table, ratio, rows_per_page, limit, with_slots)
