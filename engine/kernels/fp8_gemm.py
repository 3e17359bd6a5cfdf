"""FP8 block-scaled linears as the official DeepSeek-V4 checkpoint stores them (reference §9): y = x · Wᵀ with W e4m3
[N, K] and one scale per 128x128 block (ue8m0 as the official checkpoint ships, fp32 as Flash-Base ships).

As DeepSeek's own inference does, the activations are quantized at run time per token and 128 channels to e4m3 with a
power-of-two (ue8m0) scale, and the product accumulates in fp32 promoted every 128 values of K: for each K block the
e4m3 x e4m3 dot is summed in fp32 from zero, then multiplied by the activation's and the weight's block scales and
added to the fp32 accumulator (the tensor cores' fp8 accumulation keeps about 14 bits, so no longer run than one
block goes unpromoted). The result is rounded once to the output dtype.

- The activation quantization is exact and identical everywhere (`quantize_activations_*`): amax over the block's
  channels (a partial last block counts only its own), the scale the smallest power of two >= amax / 448 with amax
  floored at the smallest normal fp32 times 448 (as engine/kernels/quant.py rounds every ue8m0 block, so an all-zero
  block gets a tiny finite scale and zero codes, never NaN), codes round-to-nearest-even, saturated at ±448. DeepSeek's
  kernels floor amax at 1e-4 instead; only blocks whose every |x| < 1e-4 round differently, to within their scale.
- Decode (M <= DECODE_MAX_M): one kernel reads the weight once, spread over N tiles and splits of K (split-K where the
  N tiles alone would not fill the GPU, its fp32 partials summed in a fixed order by the tile's last program:
  engine/kernels/split_k.py). From 2 to QUANTIZE_FIRST_M tokens it quantizes their activations in registers as it
  goes; past that every program would redo the quantization of all tokens for each of its K blocks (at M = 64 it, not
  the weight, set the time: bench/results/quant.md), so the activations are quantized once by their own launch first.
  So they are at one token: the kernel is bound by each K block's chain of waits, not by the weight's bytes (with the
  weight already in L2, wo_b took 17.4 µs of its 19.2 on an H100), and the in-register quantization is the longest
  link; quantized first, wo_b took 11.0 µs from L2 and 17.8 from memory, 14.2 with engine/kernels/prefetch.py's L2
  prefetch ahead of it (docs/quantized-weights.md).
- Prefill: the activations are quantized once by their own launch, then a tiled GEMM runs the FP8 tensor cores
  (tl.dot on e4m3 operands), promoting per K block as above.

`fp8_block_grouped_linear` is the official `wo_a` grouped low-rank projection: x [N, G, D] against G weights of R rows
stacked as [G * R, D] (y[n, g] = x[n, g] · W_gᵀ), the same kernels over a group axis.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, multiprocessors, shared_memory_limit, use_triton
from engine.kernels.quant import FP8_MAX, block_scales, e8m0_to_float, exact_ceil_log2, round_half_even
from engine.kernels.scales import pow2
from engine.kernels.split_k import arrives_last, tile_counters

BLOCK = 128  # the checkpoint's block: weight scales per 128x128, activation scales per 128 channels
DECODE_MAX_M = 64  # rows up to this many take the weight-streaming decode kernel
QUANTIZE_FIRST_M = 16  # past this many, the decode kernel reads activations quantized by their own launch
FP8_TINY = torch.finfo(torch.float32).tiny * FP8_MAX  # the amax floor of quant.block_scales


def quantize_activations_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 codes [M, K], fp32 power-of-two scales [M, ceil(K / 128)]): x ≈ codes * scale per block."""
    m, k = x.shape
    blocks = math.ceil(k / BLOCK)
    padded = torch.zeros(m, blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    tiles = padded.view(m, blocks, BLOCK)
    scale = block_scales(tiles, FP8_MAX)  # [M, blocks, 1]
    codes = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, -1)[:, :k].contiguous(), scale.squeeze(-1)


def _row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """The weight's block scales as fp32, one row of them per weight row: [rows, K blocks]."""
    return e8m0_to_float(scale).repeat_interleave(BLOCK, 0)[:rows]


def _block_matmul(codes, act_scale, weight, w_scale) -> torch.Tensor:
    """fp32 [M, N]: per K block, the exact e4m3 products summed in fp32, times the activation's and the weight's
    block scales (`w_scale` per weight row, _row_scales), added in K order."""
    m, k = codes.shape
    n = weight.shape[0]
    out = torch.zeros(m, n, dtype=torch.float32, device=codes.device)
    for kb in range(math.ceil(k / BLOCK)):
        cols = slice(kb * BLOCK, (kb + 1) * BLOCK)
        partial = codes[:, cols].float() @ weight[:, cols].float().T
        out += partial * act_scale[:, kb, None] * w_scale[None, :, kb]
    return out


def _check(weight: torch.Tensor, scale: torch.Tensor, k: int) -> None:
    n, wk = weight.shape
    expected = (math.ceil(n / BLOCK), math.ceil(wk / BLOCK))
    if wk != k or tuple(scale.shape) != expected:
        raise ValueError(f"FP8 weight {tuple(weight.shape)} with scale {tuple(scale.shape)} does not fit K={k} "
                         f"(scale expected {expected})")  # fmt: skip
    if weight.dtype != torch.float8_e4m3fn or scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"FP8 weight must be float8_e4m3fn with float8_e8m0fnu or float32 scales, got "
                         f"{weight.dtype} and {scale.dtype}")  # fmt: skip


def fp8_block_linear_reference(x, weight, scale, out_dtype=None):
    """x [M, K] (bf16 / fp16 / fp32); weight e4m3 [N, K]; scale [ceil(N/128), ceil(K/128)] ue8m0 or fp32 -> [M, N] in
    out_dtype (default x's)."""
    _check(weight, scale, x.shape[1])
    codes, act_scale = quantize_activations_reference(x)
    return _block_matmul(codes, act_scale, weight, _row_scales(scale, weight.shape[0])).to(out_dtype or x.dtype)


def fp8_block_grouped_linear_reference(x, weight, scale, out_dtype=None):
    """x [N, G, D]; weight e4m3 [G * R, D] (group g's rows g*R..(g+1)*R); scale [ceil(G*R/128), ceil(D/128)] ->
    [N, G, R]: y[n, g] = x[n, g] · W_gᵀ. A scale block may span two groups when R is not a multiple of 128 (small
    test models); the Triton kernel needs R a multiple of 128, as every DeepSeek-V4 width is."""
    n, groups, dim = x.shape
    rows = weight.shape[0] // groups
    _check(weight, scale, dim)
    if rows * groups != weight.shape[0]:
        raise ValueError(f"grouped FP8 weight {tuple(weight.shape)} does not split into {groups} groups")
    codes, act_scale = quantize_activations_reference(x.reshape(n * groups, dim))
    codes, act_scale = codes.view(n, groups, dim), act_scale.view(n, groups, -1)
    w_scale = _row_scales(scale, weight.shape[0])
    out = [
        _block_matmul(codes[:, g], act_scale[:, g], weight[g * rows : (g + 1) * rows],
                      w_scale[g * rows : (g + 1) * rows])
        for g in range(groups)
    ]  # fmt: skip
    return torch.stack(out, dim=1).to(out_dtype or x.dtype)


# ---- Triton ----


@triton.jit
def _to_e4m3_rounding_first(v):
    """e4m3 codes of |v| <= 448, rounded to nearest (ties to even) in fp32 first, so that the cast is exact: Triton
    3.6's interpreter drops the carry when rounding crosses a power of two (31.7 -> 16), the GPU's cvt does not."""
    bits = v.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # e4m3 subnormals below 2**-6
    codes = (round_half_even(tl.abs(v) * pow2(3 - e)) * pow2(e - 3)).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    # the sign bit from v's, -0 included (tiny negatives quantize to -0 on the GPU; the interpreter drops it)
    return (codes | tl.where(bits < 0, 0x80, 0).to(tl.uint8)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _quantize_block(x, TINY: tl.constexpr, EXACT_CAST: tl.constexpr):
    """fp32 [ROWS, 128] -> (e4m3 codes, fp32 power-of-two scales [ROWS]): quantize_activations_reference's rounding,
    the scale from the float's bits (scaling by a power of two is exact, so multiply by its inverse). EXACT_CAST: round
    on the grid first (the interpreter)."""
    exponent = exact_ceil_log2(tl.div_rn(tl.maximum(tl.max(tl.abs(x), axis=1), TINY), 448.0))
    v = tl.minimum(tl.maximum(x * pow2(-exponent)[:, None], -448.0), 448.0)
    if EXACT_CAST:
        codes = _to_e4m3_rounding_first(v)
    else:
        codes = v.to(tl.float8e4nv)
    return codes, pow2(exponent)


@triton.jit
def _scale_value(raw, E8M0: tl.constexpr):
    """A weight block scale as stored -> fp32. ue8m0 byte b is 2**(b - 127): byte 0 (2**-127) is below the normal
    range that pow2 builds from bits, hence its own constant."""
    if E8M0:
        e = raw.to(tl.int32)
        return tl.where(e == 0, 5.877471754111438e-39, pow2(e - 127))
    else:
        return raw


@triton.jit
def _weight_scales(s_ptr, rows, kb, stride_s, mask, E8M0: tl.constexpr):
    """The weight's block scales for `rows` (global weight rows) at K block kb, as fp32."""
    return _scale_value(tl.load(s_ptr + (rows // 128) * stride_s + kb, mask=mask, other=127 if E8M0 else 1.0), E8M0)


@triton.jit
def _tile_scale(s_ptr, first_row, kb, stride_s, E8M0: tl.constexpr):
    """The one block scale of a tile whose rows lie in one 128-row scale block (UNIFORM_SCALE), at K block kb: a
    scalar load, no per-row vector to lay out against the accumulator."""
    return _scale_value(tl.load(s_ptr + (first_row // 128) * stride_s + kb), E8M0)


@triton.jit
def _dot_fp8(a, b, F32_DOT: tl.constexpr):
    """a [M, K] x b [K, N], e4m3 operands, the exact products summed in fp32 from zero: the FP8 tensor cores, or
    (interpreter) both upcast for an ieee dot."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


# One variant for any token count and any split length (the decode batch varies; graphs are captured per size).
@triton.jit(do_not_specialize=["M", "kb_per_split"])
def _decode_kernel(
    x_ptr, sa_ptr, w_ptr, s_ptr, out_ptr, part_ptr, counter_ptr, M, K, kb_per_split,
    stride_xm, stride_xg, stride_sam, stride_sag, stride_wn, stride_s, stride_om, stride_ps,
    R: tl.constexpr, TILES: tl.constexpr, E8M0: tl.constexpr, QUANTIZED: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, TINY: tl.constexpr,
    UNIFORM_SCALE: tl.constexpr,
):  # fmt: skip
    """Program (group g * TILES + tile, split): weight rows [tile * BLOCK_N, +BLOCK_N) of group g against all M
    tokens over K blocks [split * kb_per_split, +kb_per_split). Computed transposed (weight rows as the dot's M side)
    so the tile stays MMA-shaped for few tokens. The tokens' activations are quantized here, block by block, or with
    QUANTIZED x holds e4m3 codes and sa their scales (_quantize_kernel's). out [M, G * R]; with K split, each program
    stores its fp32 partial in part [SPLITS, M, G * R] and the tile's last program adds them (split_k). With
    UNIFORM_SCALE every tile's rows share one weight scale a K block (`_tile_scale`)."""
    g = tl.program_id(0) // TILES
    n0 = (tl.program_id(0) % TILES) * BLOCK_N
    n = n0 + tl.arange(0, BLOCK_N)
    rows = g * R + n
    m = tl.arange(0, BLOCK_M)
    c = tl.arange(0, 128)
    live_n, live_m = n < R, m < M
    x_ptrs = x_ptr + g * stride_xg + m[:, None] * stride_xm + c[None, :]
    sa_ptrs = sa_ptr + g * stride_sag + m * stride_sam
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + c[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    kb_start = tl.program_id(1) * kb_per_split
    kb_end = tl.minimum(kb_start + kb_per_split, tl.cdiv(K, 128))
    for kb in range(kb_start, kb_end):
        k_ok = (kb * 128 + c < K)[None, :]
        if QUANTIZED:
            codes = tl.load(x_ptrs + kb * 128, mask=live_m[:, None] & k_ok, other=0.0)
            act_scale = tl.load(sa_ptrs + kb, mask=live_m, other=1.0)
        else:
            xt = tl.load(x_ptrs + kb * 128, mask=live_m[:, None] & k_ok, other=0.0).to(tl.float32)
            codes, act_scale = _quantize_block(xt, TINY, F32_DOT)
        w = tl.load(w_ptrs + kb * 128, mask=live_n[:, None] & k_ok, other=0.0)
        partial = _dot_fp8(w, tl.trans(codes), F32_DOT)
        if UNIFORM_SCALE:
            acc += partial * act_scale[None, :] * _tile_scale(s_ptr, g * R + n0, kb, stride_s, E8M0)
        else:
            acc += partial * act_scale[None, :] * _weight_scales(s_ptr, rows, kb, stride_s, live_n, E8M0)[:, None]
    offs = m[None, :] * stride_om + rows[:, None]
    live = live_n[:, None] & live_m[None, :]
    if SPLITS > 1:
        tl.store(part_ptr + tl.program_id(1) * stride_ps + offs, acc, mask=live)
        if arrives_last(counter_ptr + tl.program_id(0), SPLITS):
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLITS):
                acc += tl.load(part_ptr + s * stride_ps + offs, mask=live, other=0.0, cache_modifier=".cg")
            tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=live)
    else:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["rows"])
def _quantize_kernel(
    x_ptr, codes_ptr, scale_ptr, rows, K, stride_x, ROWS: tl.constexpr, TINY: tl.constexpr, EXACT_CAST: tl.constexpr
):
    """Program (row block, K block): codes [rows, K] (bytes) and scales [rows, ceil(K / 128)] fp32."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    kb = tl.program_id(1)
    k = kb * 128 + tl.arange(0, 128)
    mask = (r < rows)[:, None] & (k < K)[None, :]
    x = tl.load(x_ptr + r.to(tl.int64)[:, None] * stride_x + k[None, :], mask=mask, other=0.0).to(tl.float32)
    codes, scale = _quantize_block(x, TINY, EXACT_CAST)
    tl.store(codes_ptr + r.to(tl.int64)[:, None] * K + k[None, :], codes, mask=mask)
    tl.store(scale_ptr + r * tl.cdiv(K, 128) + kb, scale, mask=r < rows)


@triton.jit
def _prefill_kernel(
    a_ptr, sa_ptr, w_ptr, s_ptr, out_ptr, M, K,
    stride_am, stride_ag, stride_sam, stride_sag, stride_wn, stride_s, stride_om, stride_og,
    R: tl.constexpr, E8M0: tl.constexpr, GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr, UNIFORM_SCALE: tl.constexpr,
):  # fmt: skip
    """Program (output tile, group): quantized activations [BLOCK_M, 128] x weight [BLOCK_N, 128] per K block on the
    FP8 tensor cores, promoted to the fp32 accumulator with both block scales (the weight's one scalar a K block with
    UNIFORM_SCALE). Tiles go column-major within bands of GROUP_M row tiles, so a band's weight tiles stay in L2."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(R, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_m
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    g = tl.program_id(1)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = g * R + n
    c = tl.arange(0, 128)
    live_m, live_n = m < M, n < R
    a_ptrs = a_ptr + g * stride_ag + m.to(tl.int64)[:, None] * stride_am + c[None, :]
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * stride_wn + c[None, :]
    sa_ptrs = sa_ptr + g * stride_sag + m * stride_sam
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, 128)):
        k_ok = (kb * 128 + c < K)[None, :]
        a = tl.load(a_ptrs + kb * 128, mask=live_m[:, None] & k_ok, other=0.0)
        w = tl.load(w_ptrs + kb * 128, mask=live_n[:, None] & k_ok, other=0.0)
        partial = _dot_fp8(a, tl.trans(w), F32_DOT)
        act_scale = tl.load(sa_ptrs + kb, mask=live_m, other=1.0)
        if UNIFORM_SCALE:
            acc += partial * act_scale[:, None] * _tile_scale(s_ptr, g * R + pid_n * BLOCK_N, kb, stride_s, E8M0)
        else:
            acc += partial * act_scale[:, None] * _weight_scales(s_ptr, rows, kb, stride_s, live_n, E8M0)[None, :]
    out = out_ptr + g * stride_og + m.to(tl.int64)[:, None] * stride_om + n[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live_m[:, None] & live_n[None, :])


def decode_splits(tiles: int, k_blocks: int, m: int, device: torch.device) -> int:
    """Splits of K for the decode kernel: enough programs to fill the GPU about twice over, fewer where the fp32
    partials (written and read back, 8 bytes a token and row a split; they stay in L2) would pass half the weight's
    bytes. At 64 tokens a tenth (the rule before) left wo_b and the shared expert one split: half the GPU idle."""
    want = triton.cdiv(2 * multiprocessors(device), tiles)
    affordable = max(1, (k_blocks * BLOCK) // (16 * max(m, 1)))
    splits = max(1, min(want, affordable, k_blocks))
    return triton.cdiv(k_blocks, triton.cdiv(k_blocks, splits))  # spread the blocks evenly


def decode_block_n(rows: int, m: int, device: torch.device) -> int:
    """Weight rows a decode program: 64, or 128 past QUANTIZE_FIRST_M tokens where 64-row tiles alone would fill
    the GPU twice over (wq_b), which halves how often the activations are read (bench/results/quant.md)."""
    return 128 if m > QUANTIZE_FIRST_M and triton.cdiv(rows, 64) >= 2 * multiprocessors(device) else 64


def decode_stages(device: torch.device, m: int) -> int:
    """Pipelining depth of the decode kernel: 4, or 3 past 16 tokens where a block gets 99 KB of shared memory. The
    rule dates from when those tokens' bf16 activations took as much room as the weight tile; they are e4m3 codes now
    (QUANTIZE_FIRST_M), and 4 stages there are untried. tests/engine/test_attention_shared_memory.py checks the fit."""
    if device.type == "cuda" and shared_memory_limit(device) < 200 * 1024 and m > 16:
        return 3
    return 4


def prefill_stages(device: torch.device) -> int:
    """Software-pipelining depth of the prefill GEMM: 4 stages of 32 KB where a block may use 227 KB (H100/H200), 2
    where it gets 99 KB (Ada, consumer Blackwell)."""
    if device.type != "cuda":
        return 2
    return 4 if shared_memory_limit(device) >= 200 * 1024 else 2


def _uniform_scale(rows: int, block_n: int) -> bool:
    """Whether every tile of `block_n` weight rows lies in one 128-row scale block: tiles start at multiples of
    block_n (groups of `rows` too, when rows is one), and a block_n dividing 128 then never crosses a block's edge."""
    return 128 % block_n == 0 and rows % block_n == 0


def _quantize(x, groups: int):
    """x [M, G, K] -> (e4m3 codes [M * G, K], fp32 scales [M * G, K blocks]) in one launch."""
    m, _, k = x.shape
    flat = x if x.stride(0) == groups * k and x.stride(1) == k else x.contiguous()
    flat = flat.view(m * groups, k)
    codes = torch.empty(m * groups, k, dtype=torch.float8_e4m3fn, device=x.device)
    act_scale = torch.empty(m * groups, triton.cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    quant_rows = 32
    if m:
        _quantize_kernel[(triton.cdiv(m * groups, quant_rows), triton.cdiv(k, BLOCK))](
            flat, codes, act_scale, m * groups, k, flat.stride(0),
            ROWS=quant_rows, TINY=FP8_TINY, EXACT_CAST=interpreting(), num_warps=4,
        )  # fmt: skip
    return codes, act_scale


def _launch(x, weight, scale, out, groups, rows, *, block_n=None, splits=None, num_warps=None, num_stages=None,
            quantize_first=None):  # fmt: skip
    """x [M, G, K] (any strides with unit K stride) -> out [M, G, rows] (contiguous). quantize_first (decode): the
    activations quantized by their own launch rather than in each program (default at one token and past
    QUANTIZE_FIRST_M)."""
    m, _, k = x.shape
    device = x.device
    k_blocks = triton.cdiv(k, BLOCK)
    e8m0 = scale.dtype == torch.float8_e8m0fnu
    s = scale.view(torch.uint8) if e8m0 else scale
    w = weight
    f32_dot = interpreting()
    if m <= DECODE_MAX_M:
        block_m = max(16, triton.next_power_of_2(m))
        block_n = block_n or decode_block_n(groups * rows, m, device)
        tiles = triton.cdiv(rows, block_n)
        splits = splits or decode_splits(groups * tiles, k_blocks, m, device)
        kb_per_split = triton.cdiv(k_blocks, splits)
        splits = triton.cdiv(k_blocks, kb_per_split)
        part = out if splits == 1 else torch.empty(splits, m, groups * rows, dtype=torch.float32, device=device)
        counters = out if splits == 1 else tile_counters(device, groups * tiles)  # out stands in when unread
        quantized = (m == 1 or m > QUANTIZE_FIRST_M) if quantize_first is None else quantize_first
        if quantized:
            codes, act_scale = _quantize(x, groups)
            a, a_strides = codes, (groups * k, k, groups * k_blocks, k_blocks)
        else:
            a, act_scale, a_strides = x, x, (x.stride(0), x.stride(1), 0, 0)  # x stands in for the unread scales
        _decode_kernel[(groups * tiles, splits)](
            a, act_scale, w, s, out, part, counters, m, k, kb_per_split,
            *a_strides, w.stride(0), s.stride(0), groups * rows, part.stride(0) if splits > 1 else 0,
            R=rows, TILES=tiles, E8M0=e8m0, QUANTIZED=quantized, SPLITS=splits,
            BLOCK_M=block_m, BLOCK_N=block_n,
            F32_DOT=f32_dot, TINY=FP8_TINY, UNIFORM_SCALE=_uniform_scale(rows, block_n), num_warps=num_warps or 4,
            num_stages=num_stages or decode_stages(device, m),
        )  # fmt: skip
        return out
    codes, act_scale = _quantize(x, groups)
    block_m, block_n = 128, block_n or 128
    grid = (triton.cdiv(m, block_m) * triton.cdiv(rows, block_n), groups)
    _prefill_kernel[grid](
        codes, act_scale, w, s, out, m, k,
        groups * k, k, groups * k_blocks, k_blocks, w.stride(0), s.stride(0), groups * rows, rows,
        R=rows, E8M0=e8m0, GROUP_M=8, BLOCK_M=block_m, BLOCK_N=block_n, F32_DOT=f32_dot,
        UNIFORM_SCALE=_uniform_scale(rows, block_n), num_warps=num_warps or 8,
        num_stages=num_stages or prefill_stages(device),
    )  # fmt: skip
    return out


def fp8_block_linear_triton(x, weight, scale, out_dtype=None, **launch):
    """fp8_block_linear_reference in one or two launches (decode: the activations' quantization at one token and past
    QUANTIZE_FIRST_M, then the GEMM; prefill: the quantization, then the GEMM).
    `launch`: block_n=, splits=, num_warps=, num_stages=, quantize_first=."""
    m, k = x.shape
    _check(weight, scale, k)
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    return _launch(x.unsqueeze(1), weight, scale, out, 1, n, **launch)


def fp8_block_grouped_linear_triton(x, weight, scale, out_dtype=None, **launch):
    """fp8_block_grouped_linear_reference, the same launches over a group axis."""
    n, groups, dim = x.shape
    rows = weight.shape[0] // groups
    _check(weight, scale, dim)
    if rows % BLOCK or rows * groups != weight.shape[0]:
        raise ValueError(f"grouped FP8 weight {tuple(weight.shape)} does not split into {groups} groups of 128-row "
                         "blocks")  # fmt: skip
    out = torch.empty(n, groups, rows, dtype=out_dtype or x.dtype, device=x.device)
    if n == 0:
        return out
    if x.stride(2) != 1:
        x = x.contiguous()
    return _launch(x, weight, scale, out, groups, rows, **launch)


def quantize_activations_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_activations_reference in one launch (what the prefill GEMM reads)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    return _quantize(x.unsqueeze(1), 1)


def _triton_ok(x: torch.Tensor) -> bool:
    return use_triton(x.device) and x.dtype != torch.float64


def fp8_block_linear(x, weight, scale, out_dtype=None):
    """The Triton kernels on CUDA, the reference elsewhere and for float64."""
    impl = fp8_block_linear_triton if _triton_ok(x) else fp8_block_linear_reference
    return impl(x, weight, scale, out_dtype)


def fp8_block_grouped_linear(x, weight, scale, out_dtype=None):
    rows_tile = (weight.shape[0] // x.shape[1]) % BLOCK == 0
    impl = fp8_block_grouped_linear_triton if _triton_ok(x) and rows_tile else fp8_block_grouped_linear_reference
    return impl(x, weight, scale, out_dtype)


def quantize_activations(x):
    impl = quantize_activations_triton if _triton_ok(x) else quantize_activations_reference
    return impl(x)
