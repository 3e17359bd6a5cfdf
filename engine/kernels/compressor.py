"""The c4 / c128 compressor (reference §5.2): gated softmax pooling of every `ratio` tokens into one compressed row,
then RMSNorm, RoPE at the window's first position, and the quantisation the cache row simulates.

State per request, in the official layout: `kv_state`, `score_state` [coff*ratio, coff*dim] fp32 (coff = 2 for the
overlapping ratio-4 compressor, else 1). Overlapping: rows [0, ratio) hold the previous window (its first-half
features feed this window), rows [ratio, 2*ratio) the current one, slot ratio + pos % ratio; otherwise slot
pos % ratio. Scores carry the learned position bias and start at -inf, so an empty previous window weighs nothing.

`compress_chunk` takes one request's prefill chunk of any length and writes the rows it closes into the paged cache
(the torch reference: `pool_windows`, `finish_rows`, then the row format's writer; the Triton path: a program per
closed window, then one that moves the state on); `compressor_decode_step` advances a batch of requests by one token
each likewise; its Triton kernel is capture-safe (fixed grid, every request runs, those not closing a window only
store their projections).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import use_triton
from engine.kernels.kv_format import INDEX_SCALE_BYTES, MAIN_SCALE_BYTES, write_index_keys
from engine.kernels.kv_rows import write_main_rows
from engine.kernels.quant import fp4_round, simulate_index_fp4, simulate_kv_row_fp8
from engine.kernels.rope import rope_angles, rotate_interleaved
from engine.kernels.scales import ceil_log2, pow2, pow2_ceil

_MAIN_SCALE_BYTES = tl.constexpr(MAIN_SCALE_BYTES)
_INDEX_SCALE_BYTES = tl.constexpr(INDEX_SCALE_BYTES)


def pool_windows(
    kv: torch.Tensor,
    score: torch.Tensor,
    positions: torch.Tensor,
    first: int,
    kv_state: torch.Tensor,
    score_state: torch.Tensor,
    ape: torch.Tensor,
    ratio: int,
) -> torch.Tensor:
    """Feed one request's next tokens (kv, score [T, coff*dim] fp32 at consecutive `positions`, from `first`, given on
    the host so that no step waits for the device); returns the pooled rows [windows closed, dim] fp32 and leaves the
    state ready for the next token."""
    overlap = ratio == 4
    base = ratio if overlap else 0
    done = first % ratio  # tokens of the current window already in the state
    kv = torch.cat([kv_state[base : base + done], kv])
    score = torch.cat([score_state[base : base + done], score + ape[positions % ratio]])
    n_win = kv.shape[0] // ratio
    usable = n_win * ratio
    left = kv.shape[0] - usable
    width = kv.shape[1]
    dim = width // (2 if overlap else 1)
    if n_win == 0:
        kv_state[base : base + left], score_state[base : base + left] = kv, score
        return kv.new_empty(0, dim)
    windows_kv, windows_score = kv[:usable].view(n_win, ratio, width), score[:usable].view(n_win, ratio, width)
    if overlap:
        prev_kv = torch.cat([kv_state[None, :ratio, :dim], windows_kv[:-1, :, :dim]])
        prev_score = torch.cat([score_state[None, :ratio, :dim], windows_score[:-1, :, :dim]])
        kv_state[:ratio], score_state[:ratio] = windows_kv[-1], windows_score[-1]
        windows_kv = torch.cat([prev_kv, windows_kv[:, :, dim:]], dim=1)
        windows_score = torch.cat([prev_score, windows_score[:, :, dim:]], dim=1)
    kv_state[base : base + left], score_state[base : base + left] = kv[usable:], score[usable:]
    return (windows_kv * torch.softmax(windows_score, dim=1)).sum(dim=1)


def finish_rows(
    pooled: torch.Tensor,
    first_row: int,
    ratio: int,
    norm_weight: torch.Tensor,
    eps: float,
    inv_freq: torch.Tensor,
    for_indexer: bool,
    quant_sim: bool,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Pooled rows -> cache rows: RMSNorm (in `dtype`'s precision, as the reference), RoPE at each window's first
    position, and the FP8 (main KV) or Hadamard + FP4 (index keys) rounding when quant_sim is on."""
    x = pooled.to(dtype).float()
    rows = (norm_weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)).to(dtype)
    positions = (torch.arange(len(rows), device=rows.device) + first_row) * ratio
    rows = rotate_interleaved(rows, *rope_angles(positions, inv_freq))
    if not quant_sim:
        return rows
    return simulate_index_fp4(rows) if for_indexer else simulate_kv_row_fp8(rows, 2 * inv_freq.shape[0])


def compress_chunk_reference(
    kv, score, positions, first: int, kv_state, score_state, ape, norm_weight, eps, inv_freq, out: torch.Tensor,
    slots: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool, dtype: torch.dtype,
):  # fmt: skip
    """Prefill: one request's next tokens (kv, score [T, coff*dim] fp32 at consecutive `positions` from `first`) into
    its compressor state (kv_state, score_state, the request's own); the rows of the windows they close, finished in
    `dtype`'s precision, go to physical `slots` [closed] of `out`, as the decode step's rows do."""
    pooled = pool_windows(kv, score, positions, first, kv_state, score_state, ape, ratio)
    rows = finish_rows(pooled, first // ratio, ratio, norm_weight, eps, inv_freq, for_indexer, quant_sim, dtype)
    _store_rows(out, slots, rows, rows_per_page, 2 * inv_freq.shape[0], for_indexer)


@triton.jit
def _concat_rows(kv_ptr, score_ptr, ape_ptr, state_kv, state_score, t, col, stride_kv, stride_score, done,
                 C: tl.constexpr, BASE: tl.constexpr, RATIO: tl.constexpr):  # fmt: skip
    """Rows t of the request's current window continued by the chunk (rows below `done` are the state's, the others
    the chunk's with the learned position bias added), at columns col: (kv, score) fp32."""
    in_state = t < done
    chunk = tl.maximum(t - done, 0).to(tl.int64)
    state_at = (BASE + tl.where(in_state, t, 0)) * C + col
    kv = tl.where(in_state, tl.load(state_kv + state_at, mask=in_state, other=0.0),
                  tl.load(kv_ptr + chunk * stride_kv + col, mask=~in_state, other=0.0))  # fmt: skip
    bias = tl.load(ape_ptr + (tl.maximum(t, 0) % RATIO) * C + col, mask=~in_state, other=0.0)
    score = tl.where(in_state, tl.load(state_score + state_at, mask=in_state, other=0.0),
                     tl.load(score_ptr + chunk * stride_score + col, mask=~in_state, other=0.0) + bias)  # fmt: skip
    return kv, score


# Counts and offsets are runtime arguments Triton does not specialise on (a value of 1 would compile a variant of its
# own after boot's warm-up: a one-token chunk leaves one row of a window).
@triton.jit(do_not_specialize=["done", "first_row"])
def _compress_chunk_kernel(
    kv_ptr, score_ptr, ape_ptr, norm_ptr, inv_freq_ptr, kv_state_ptr, score_state_ptr, slot_ptr, out_ptr,
    scale_out_ptr, hadamard_ptr, pooled_ptr, stride_kv, stride_score, done, first_row, eps,
    RATIO: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr, ROWS_PER_PAGE: tl.constexpr,
    FOR_INDEXER: tl.constexpr, QUANT_SIM: tl.constexpr, FP8_OUT: tl.constexpr, ROUND_BF16: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    """A program per window the chunk closes: pool its slots (an overlapping window's first half is the previous
    window's first-half features, the state's for the chunk's first window), then finish and store its row. The
    state is only read here; `_compress_chunk_state_kernel` moves it on after."""
    w = tl.program_id(0)
    OVERLAP: tl.constexpr = RATIO == 4
    COFF: tl.constexpr = 2 if OVERLAP else 1
    C: tl.constexpr = COFF * DIM
    BASE: tl.constexpr = RATIO if OVERLAP else 0
    k = tl.arange(0, COFF * RATIO)
    if OVERLAP:  # t < 0: the previous window, held in the state's first RATIO rows (BASE + t = k)
        t = tl.where(k < RATIO, (w - 1) * RATIO + k, w * RATIO + k - RATIO)
    else:
        t = w * RATIO + k
    for f0 in range(0, DIM, BD):
        f = f0 + tl.arange(0, BD)
        wkv, ws = _concat_rows(kv_ptr, score_ptr, ape_ptr, kv_state_ptr, score_state_ptr, t[:, None],
                               _window_columns(k, f, RATIO, DIM), stride_kv, stride_score, done, C, BASE,
                               RATIO)  # fmt: skip
        tl.store(pooled_ptr + w * DIM + f, _softmax_pool(wkv, ws))
    tl.debug_barrier()
    slot = tl.load(slot_ptr + w).to(tl.int64)
    _finish_and_store(tl.load(pooled_ptr + w * DIM + tl.arange(0, DIM)), first_row + w, slot // ROWS_PER_PAGE,
                      slot % ROWS_PER_PAGE, norm_ptr, inv_freq_ptr, out_ptr, scale_out_ptr, hadamard_ptr, eps, RATIO,
                      DIM, ROPE, ROWS_PER_PAGE, FOR_INDEXER, QUANT_SIM, FP8_OUT, ROUND_BF16)  # fmt: skip


@triton.jit(do_not_specialize=["done", "closed", "left"])
def _compress_chunk_state_kernel(
    kv_ptr, score_ptr, ape_ptr, kv_state_ptr, score_state_ptr, stride_kv, stride_score, done, closed, left,
    RATIO: tl.constexpr, C: tl.constexpr,
):  # fmt: skip
    """One program: the state after the chunk, as pool_windows leaves it — an overlapping compressor's last closed
    window becomes the previous one (first, while the rows it reads are still there), then the unfinished window."""
    OVERLAP: tl.constexpr = RATIO == 4
    BASE: tl.constexpr = RATIO if OVERLAP else 0
    c = tl.arange(0, C)
    if OVERLAP:  # noqa: SIM102 (a constexpr, then a runtime value: Triton compiles no `and` of the two)
        if closed > 0:
            for k in range(RATIO):
                kv, score = _concat_rows(kv_ptr, score_ptr, ape_ptr, kv_state_ptr, score_state_ptr,
                                         (closed - 1) * RATIO + k, c, stride_kv, stride_score, done, C, BASE,
                                         RATIO)  # fmt: skip
                tl.store(kv_state_ptr + k * C + c, kv)
                tl.store(score_state_ptr + k * C + c, score)
            tl.debug_barrier()
    for k in range(left):
        kv, score = _concat_rows(kv_ptr, score_ptr, ape_ptr, kv_state_ptr, score_state_ptr, closed * RATIO + k, c,
                                 stride_kv, stride_score, done, C, BASE, RATIO)  # fmt: skip
        tl.store(kv_state_ptr + (BASE + k) * C + c, kv)
        tl.store(score_state_ptr + (BASE + k) * C + c, score)


def compress_chunk_triton(
    kv, score, positions, first: int, kv_state, score_state, ape, norm_weight, eps, inv_freq, out: torch.Tensor,
    slots: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool, dtype: torch.dtype,
):  # fmt: skip
    """`compress_chunk_reference` in two launches whatever the chunk's length (the torch reference issues about 60
    ops): the closed windows' rows, then the state."""
    dim = norm_weight.shape[0]
    done = first % ratio
    closed, left = (done + len(kv)) // ratio, (done + len(kv)) % ratio
    if closed:
        fp8 = out.dtype == torch.uint8
        hadamard = _hadamard_matrix(dim, kv.device) if for_indexer and quant_sim else kv
        pooled = torch.empty(closed, dim, device=kv.device, dtype=torch.float32)
        _compress_chunk_kernel[(closed,)](
            kv, score, ape, norm_weight, inv_freq, kv_state, score_state, slots, out,
            out.view(torch.float32) if for_indexer and fp8 else out, hadamard, pooled, kv.stride(0), score.stride(0),
            done, first // ratio, eps, RATIO=ratio, DIM=dim, ROPE=2 * inv_freq.shape[0], ROWS_PER_PAGE=rows_per_page,
            FOR_INDEXER=for_indexer, QUANT_SIM=quant_sim, FP8_OUT=fp8, ROUND_BF16=dtype == torch.bfloat16,
            BD=min(dim, 64),
        )  # fmt: skip
    _compress_chunk_state_kernel[(1,)](kv, score, ape, kv_state, score_state, kv.stride(0), score.stride(0), done,
                                       closed, left, RATIO=ratio, C=kv.shape[1])  # fmt: skip


def compress_chunk(
    kv, score, positions, first: int, kv_state, score_state, ape, norm_weight, eps, inv_freq, out: torch.Tensor,
    slots: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool, dtype: torch.dtype,
):  # fmt: skip
    """The prefill compressor: the Triton kernels on CUDA for bf16 and fp32 models, the reference elsewhere (float64
    models round nowhere to fp32)."""
    triton_ok = use_triton(kv.device) and dtype in (torch.bfloat16, torch.float32)
    impl = compress_chunk_triton if triton_ok else compress_chunk_reference
    impl(kv, score, positions, first, kv_state, score_state, ape, norm_weight, eps, inv_freq, out, slots,
         rows_per_page, ratio, for_indexer, quant_sim, dtype)  # fmt: skip


def compressor_decode_step_reference(
    kv, score, ape, norm_weight, eps, inv_freq, kv_state, score_state, seq_slot, positions, page_table,
    out: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool,
):  # fmt: skip
    """One token per request: kv, score [B, coff*dim] fp32; states [slots, coff*ratio, coff*dim] fp32; `out` the
    layer's main-row (or, for the indexer, index-key) storage in a kv_format format; a closed window's row r goes to
    physical slot page_table[b, r // rows_per_page] * rows_per_page + r % rows_per_page."""
    for b in range(kv.shape[0]):
        slot, pos = int(seq_slot[b]), int(positions[b])
        pooled = pool_windows(kv[b : b + 1], score[b : b + 1], positions[b : b + 1], pos, kv_state[slot],
                              score_state[slot], ape, ratio)  # fmt: skip
        if len(pooled):
            row = (pos + 1) // ratio - 1
            rows = finish_rows(pooled, row, ratio, norm_weight, eps, inv_freq, for_indexer, quant_sim, torch.float32)
            physical = (page_table[b, row // rows_per_page].long() * rows_per_page + row % rows_per_page).view(1)
            _store_rows(out, physical, rows, rows_per_page, 2 * inv_freq.shape[0], for_indexer)


def _store_rows(out: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, rows_per_page: int, rope_dim: int,
                for_indexer: bool) -> None:  # fmt: skip
    """Finished rows into the layer's main-row (or index-key) storage `out`, a kv_format format, at physical slots."""
    if for_indexer:
        write_index_keys(out, slots, rows)
    elif out.dtype == torch.uint8:
        write_main_rows(out, slots, rows, rows_per_page, rope_dim)
    else:
        out[slots] = rows.to(out.dtype)


@triton.jit
def _window_columns(k, f, RATIO: tl.constexpr, DIM: tl.constexpr):
    """The state's columns [COFF * RATIO, BD] of features f for a window's slots k: an overlapping window's first
    RATIO slots are the previous window's first-half features, the others the second half."""
    if RATIO == 4:
        col = tl.where(k[:, None] < RATIO, f[None, :], DIM + f[None, :])
    else:
        col = f[None, :] + 0 * k[:, None]
    return col


@triton.jit
def _softmax_pool(kv, score):
    """Gated softmax pooling over a window's slots (axis 0)."""
    e = tl.exp(score - tl.max(score, axis=0)[None, :])
    return tl.sum(kv * e, axis=0) / tl.sum(e, axis=0)


@triton.jit
def _finish_and_store(
    x, row, page, r, norm_ptr, inv_freq_ptr, out_ptr, scale_out_ptr, hadamard_ptr, eps,
    RATIO: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr, ROWS_PER_PAGE: tl.constexpr,
    FOR_INDEXER: tl.constexpr, QUANT_SIM: tl.constexpr, FP8_OUT: tl.constexpr, ROUND_BF16: tl.constexpr,
):  # fmt: skip
    """`finish_rows` and the cache write of one pooled row x [DIM] fp32 (compressed row `row`, at row r of `page`);
    ROUND_BF16 rounds where finish_rows does in a bf16 model."""
    d = tl.arange(0, DIM)
    if ROUND_BF16:
        x = x.to(tl.bfloat16).to(tl.float32)
    x = tl.load(norm_ptr + d) * x * tl.rsqrt(tl.sum(x * x, axis=0) / DIM + eps)
    if ROUND_BF16:
        x = x.to(tl.bfloat16).to(tl.float32)
    # RoPE on the last ROPE channels, interleaved pairs, at the window's first position.
    even, odd = tl.split(tl.reshape(x, (DIM // 2, 2)))
    pair = tl.arange(0, DIM // 2)
    is_rope = pair >= (DIM - ROPE) // 2
    freq = tl.load(inv_freq_ptr + pair - (DIM - ROPE) // 2, mask=is_rope, other=0.0)
    angle = (row * RATIO).to(tl.float32) * freq
    cos, sin = tl.cos(angle), tl.sin(angle)
    x = tl.reshape(tl.join(tl.where(is_rope, even * cos - odd * sin, even),
                           tl.where(is_rope, even * sin + odd * cos, odd)), (DIM,))  # fmt: skip
    if ROUND_BF16:
        x = x.to(tl.bfloat16).to(tl.float32)
    if FOR_INDEXER:
        if QUANT_SIM:  # Hadamard rotation (orthonormal), then FP4 per 32 with a power-of-two scale
            h = tl.load(hadamard_ptr + d[:, None] * DIM + d[None, :])
            x = tl.sum(x[:, None] * h, axis=0)
            if ROUND_BF16:
                x = x.to(tl.bfloat16).to(tl.float32)
            blocks = tl.reshape(x, (DIM // 32, 32))
            scale = pow2_ceil(tl.max(tl.abs(blocks), axis=1) / 6.0)
            x = tl.reshape(fp4_round(blocks / scale[:, None]) * scale[:, None], (DIM,))
        if FP8_OUT:  # DIM e4m3 values per row, then the row's fp32 scale after the page's values
            row_scale = pow2_ceil(tl.max(tl.abs(x), axis=0) / 448.0)
            values = (x / row_scale).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
            page_bytes = ROWS_PER_PAGE * (DIM + _INDEX_SCALE_BYTES)
            tl.store(out_ptr + page * page_bytes + r * DIM + d, values)
            tl.store(scale_out_ptr + page * (page_bytes // 4) + ROWS_PER_PAGE * DIM // 4 + r, row_scale)
        else:
            tl.store(out_ptr + (page * ROWS_PER_PAGE + r) * DIM + d, x.to(out_ptr.dtype.element_ty))
    else:
        NOPE: tl.constexpr = DIM - ROPE
        nope_blocks = tl.reshape(x, (DIM // 64, 64))
        nb = tl.arange(0, DIM // 64)
        exponent = tl.where(nb < NOPE // 64, ceil_log2(tl.max(tl.abs(nope_blocks), axis=1) / 448.0), 0)
        scale = pow2(exponent)
        if QUANT_SIM or FP8_OUT:  # the nope channels on the e4m3 grid of their block's scale
            q8 = (nope_blocks / scale[:, None]).to(tl.float8e4nv)
            rounded = tl.reshape(q8.to(tl.float32) * scale[:, None], (DIM,))
            x = tl.where(d < NOPE, rounded, x)
        if FP8_OUT:  # the 584-byte row: 448 e4m3, 64 bf16, then the page's scale bytes
            data_bytes = NOPE + 2 * ROPE
            page_base = out_ptr + page * (ROWS_PER_PAGE * (data_bytes + _MAIN_SCALE_BYTES))
            codes = tl.reshape(q8.to(tl.uint8, bitcast=True), (DIM,))
            tl.store(page_base + r * data_bytes + d, codes, mask=d < NOPE)
            rope_ptr = (page_base + r * data_bytes + NOPE).to(tl.pointer_type(tl.bfloat16), bitcast=True)
            tl.store(rope_ptr + (d - NOPE), x.to(tl.bfloat16), mask=d >= NOPE)
            exps = (exponent + 127).to(tl.uint8)
            tl.store(page_base + ROWS_PER_PAGE * data_bytes + r * _MAIN_SCALE_BYTES + nb, exps, mask=nb < NOPE // 64)
        else:
            tl.store(out_ptr + (page * ROWS_PER_PAGE + r) * DIM + d, x.to(out_ptr.dtype.element_ty))


@triton.jit
def _compressor_step_kernel(
    kv_ptr, score_ptr, ape_ptr, norm_ptr, inv_freq_ptr, kv_state_ptr, score_state_ptr, slot_ptr, pos_ptr,
    pt_ptr, out_ptr, scale_out_ptr, hadamard_ptr, pooled_ptr,
    stride_in, stride_state_slot, stride_ptb, eps,
    RATIO: tl.constexpr, DIM: tl.constexpr, ROPE: tl.constexpr, ROWS_PER_PAGE: tl.constexpr,
    FOR_INDEXER: tl.constexpr, QUANT_SIM: tl.constexpr, FP8_OUT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    OVERLAP: tl.constexpr = RATIO == 4
    COFF: tl.constexpr = 2 if OVERLAP else 1
    C: tl.constexpr = COFF * DIM
    BASE: tl.constexpr = RATIO if OVERLAP else 0
    slot = tl.load(slot_ptr + b).to(tl.int64)
    pos = tl.load(pos_ptr + b)
    j = pos % RATIO
    state_kv = kv_state_ptr + slot * stride_state_slot
    state_score = score_state_ptr + slot * stride_state_slot
    c = tl.arange(0, C)
    tl.store(state_kv + (BASE + j) * C + c, tl.load(kv_ptr + b * stride_in + c))
    tl.store(state_score + (BASE + j) * C + c, tl.load(score_ptr + b * stride_in + c) + tl.load(ape_ptr + j * C + c))
    if (pos + 1) % RATIO == 0:
        tl.debug_barrier()  # the stores above are read back below by other threads
        # Pool per feature over the window's slots: overlapping windows take the previous window's first half.
        w = tl.arange(0, COFF * RATIO)
        for f0 in range(0, DIM, BD):
            f = f0 + tl.arange(0, BD)
            col = _window_columns(w, f, RATIO, DIM)
            wkv = tl.load(state_kv + w[:, None] * C + col)
            ws = tl.load(state_score + w[:, None] * C + col)
            tl.store(pooled_ptr + b * DIM + f, _softmax_pool(wkv, ws))
        tl.debug_barrier()
        row = (pos + 1) // RATIO - 1
        page = tl.load(pt_ptr + b * stride_ptb + row // ROWS_PER_PAGE).to(tl.int64)
        _finish_and_store(tl.load(pooled_ptr + b * DIM + tl.arange(0, DIM)), row, page, row % ROWS_PER_PAGE, norm_ptr,
                          inv_freq_ptr, out_ptr, scale_out_ptr, hadamard_ptr, eps, RATIO, DIM, ROPE, ROWS_PER_PAGE,
                          FOR_INDEXER, QUANT_SIM, FP8_OUT, False)  # fmt: skip
        if OVERLAP:  # the current window becomes the previous one
            tl.debug_barrier()
            for k in range(RATIO):
                tl.store(state_kv + k * C + c, tl.load(state_kv + (RATIO + k) * C + c))
                tl.store(state_score + k * C + c, tl.load(state_score + (RATIO + k) * C + c))


def compressor_decode_step_triton(
    kv, score, ape, norm_weight, eps, inv_freq, kv_state, score_state, seq_slot, positions, page_table,
    out: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool,
):  # fmt: skip
    batch, dim = kv.shape[0], norm_weight.shape[0]
    fp8 = out.dtype == torch.uint8
    hadamard = _hadamard_matrix(dim, kv.device) if for_indexer and quant_sim else kv
    scales = out.view(torch.float32) if for_indexer and fp8 else out
    pooled = torch.empty(batch, dim, device=kv.device, dtype=torch.float32)
    _compressor_step_kernel[(batch,)](
        kv, score, ape, norm_weight, inv_freq, kv_state, score_state, seq_slot, positions, page_table,
        out, scales, hadamard, pooled, kv.stride(0), kv_state.stride(0), page_table.stride(0), eps,
        RATIO=ratio, DIM=dim, ROPE=2 * inv_freq.shape[0], ROWS_PER_PAGE=rows_per_page, FOR_INDEXER=for_indexer,
        QUANT_SIM=quant_sim, FP8_OUT=fp8, BD=min(dim, 64),
    )  # fmt: skip


def compressor_decode_step(
    kv, score, ape, norm_weight, eps, inv_freq, kv_state, score_state, seq_slot, positions, page_table,
    out: torch.Tensor, rows_per_page: int, ratio: int, for_indexer: bool, quant_sim: bool,
):  # fmt: skip
    impl = compressor_decode_step_triton if use_triton(kv.device) else compressor_decode_step_reference
    return impl(kv, score, ape, norm_weight, eps, inv_freq, kv_state, score_state, seq_slot, positions, page_table,
                out, rows_per_page, ratio, for_indexer, quant_sim)  # fmt: skip


_HADAMARD: dict[tuple[int, torch.device], torch.Tensor] = {}


def _hadamard_matrix(n: int, device) -> torch.Tensor:
    """The orthonormal n x n Hadamard matrix, made once per size and device: built per step it was 30 launches, and
    a matrix made outside a CUDA graph capture (the warm-up run makes it) is a constant the graph only reads."""
    key = (n, torch.device(device))
    if key not in _HADAMARD:
        _HADAMARD[key] = _sylvester(n, key[1])
    return _HADAMARD[key]


def _sylvester(n: int, device) -> torch.Tensor:
    h = torch.ones(1, 1, device=device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h * n**-0.5).contiguous()
