"""Block quantisation of the official DeepSeek-V4 checkpoint formats (reference §9, §11.2).

- FP8 e4m3 with power-of-two (ue8m0) block scales: weights in 128x128 blocks, activations / KV rows per 64 or 128
  along the last dimension.
- FP4 e2m1 (MXFP4) with ue8m0 scales per 32 along the last dimension; two codes per byte, low nibble = even element.
- NVFP4 (NVIDIA ModelOpt's checkpoints): the same packed e2m1 codes with an e4m3 scale per 16 and one fp32 scale per
  tensor (`weight_scale_2` = amax / (6 * 448)); a value is code x scale x global scale.

`*_simulate` functions round-trip a tensor through the format in place of the real low-precision storage, as the
official inference code does for its quantisation-aware-trained activations (`EngineConfig.quant_sim`).

The index queries' simulation (46-50 torch ops, run per c4 layer and step) also has a one-launch Triton kernel
(`simulate_index_fp4` picks); `index_queries` runs the indexer's whole query step in that launch: RoPE, the
simulation, and the head weights' cast and scale.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import use_triton
from engine.kernels.rope import rope_reference
from engine.kernels.scales import pow2

FP8_MAX = 448.0
FP4_MAX = 6.0
KV_FP8_BLOCK = 64  # the nope channels of a KV row carry one ue8m0 scale per 64 (the 584-byte row)
INDEX_FP4_BLOCK = 32
NVFP4_BLOCK = 16  # values per e4m3 scale in NVIDIA's NVFP4
# The eight magnitudes of e2m1; bit 3 of a code is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x: a scale that ue8m0 (exponent-only) represents exactly."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def block_scales(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
    amax = blocks.abs().amax(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny * qmax)
    return _pow2_ceil(amax / qmax)


def _round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e2m1 value (ties to the even code), keeping the sign; |x| <= 6 expected. The values are
    0, 0.5, ..., 2 (step 0.5), 3, 4 (step 1) and 6 (step 2), and in each range a value's code has the parity of its
    multiple of the step, so round-half-to-even on the multiple is exact: no table to copy to the device (which a
    CUDA graph capture forbids)."""
    mag = x.abs()
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(x.dtype)
    return torch.copysign(torch.round(mag / step) * step, x)


def _working(x: torch.Tensor) -> torch.Tensor:
    """At least fp32; float64 stays float64 so that a float64 model rounds exactly the same way chunk by chunk."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def fp8_simulate(x: torch.Tensor, block: int) -> torch.Tensor:
    """Round-trip `x` through e4m3 with one ue8m0 scale per `block` elements of the last dimension."""
    shape, dtype = x.shape, x.dtype
    blocks = _working(x).unflatten(-1, (-1, block))
    scale = block_scales(blocks, FP8_MAX)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(blocks.dtype)
    return (q * scale).reshape(shape).to(dtype)


def fp4_simulate(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round-trip `x` through e2m1 with one ue8m0 scale per `block` elements of the last dimension."""
    shape, dtype = x.shape, x.dtype
    blocks = _working(x).unflatten(-1, (-1, block))
    scale = block_scales(blocks, FP4_MAX)
    q = _round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX))
    return (q * scale).reshape(shape).to(dtype)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Walsh-Hadamard transform of the last dimension (a power of two), computed in at least fp32."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"Hadamard size {n} must be a power of two"
    y = _working(x)
    h = 1
    while h < n:  # Sylvester butterflies: log2(n) passes of pairwise sums and differences
        y = y.unflatten(-1, (-1, 2, h))
        y = torch.cat([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-1).flatten(-2)
        h *= 2
    return (y * (n**-0.5)).to(x.dtype)


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    return scale.to(torch.float8_e8m0fnu)


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    if scale.dtype == torch.float8_e8m0fnu:
        return torch.exp2(scale.view(torch.uint8).float() - 127.0)
    return scale.float()


def quantize_fp8_weight(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 [out, in], ue8m0 scale [ceil(out/block), ceil(in/block)])."""
    out_f, in_f = w.shape
    rows, cols = math.ceil(out_f / block), math.ceil(in_f / block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    tiles = padded.view(rows, block, cols, block).permute(0, 2, 1, 3).reshape(rows, cols, block * block)
    scale = block_scales(tiles, FP8_MAX)  # [rows, cols, 1]
    q = (tiles / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    q = q.view(rows, cols, block, block).permute(0, 2, 1, 3).reshape(rows * block, cols * block)
    return q[:out_f, :in_f].contiguous(), _e8m0(scale.squeeze(-1))


def dequantize_fp8_weight(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = 128
) -> torch.Tensor:
    """e4m3 [out, in] with a block scale [ceil(out/b), ceil(in/b)] (ue8m0 or fp32) -> `dtype` [out, in]."""
    out_f, in_f = w.shape
    expected = (math.ceil(out_f / block), math.ceil(in_f / block))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"FP8 scale shape {tuple(scale.shape)} does not fit weight {tuple(w.shape)} (expected {expected})"
        )
    s = e8m0_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    return (w.float() * s).to(dtype)


def _pack_e2m1(q: torch.Tensor) -> torch.Tensor:
    """e2m1 values [.., n] -> int8 [.., n/2]: sign in bit 3 of each code, low nibble = even element."""
    codes = torch.bucketize(q.abs(), E2M1_VALUES.to(q.device)).to(torch.uint8) | ((q < 0).to(torch.uint8) << 3)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def _unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """int8 [.., n/2] packed codes -> their e2m1 values [.., n] in fp32."""
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).flatten(-2).long()
    values = E2M1_VALUES.to(packed.device)[codes & 7]
    return torch.where(codes >= 8, -values, values)


def _per_block(values: torch.Tensor, scale: torch.Tensor, what: str) -> torch.Tensor:
    """A per-block scale [.., n / block] widened to the values [.., n] it scales."""
    block = values.shape[-1] // scale.shape[-1]
    if scale.shape[-1] * block != values.shape[-1]:
        raise ValueError(f"{what} scale shape {tuple(scale.shape)} does not fit {values.shape[-1]} values")
    return scale.repeat_interleave(block, -1)


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in/2] packed e2m1 codes, low nibble = even element; ue8m0 scale [out, in/block])."""
    blocks = w.float().unflatten(-1, (-1, block))
    scale = block_scales(blocks, FP4_MAX)
    q = _round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return _pack_e2m1(q), _e8m0(scale.squeeze(-1))


def dequantize_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """int8 [out, in/2] packed e2m1 + ue8m0 scale [out, in/32] -> `dtype` [out, in]."""
    values = _unpack_e2m1(packed)
    return (values * _per_block(values, e8m0_to_float(scale), "FP4")).to(dtype)


def quantize_nvfp4_weight(w: torch.Tensor, block: int = NVFP4_BLOCK) -> tuple[torch.Tensor, ...]:
    """[out, in] -> (int8 [out, in/2] packed e2m1 codes, e4m3 scale [out, in/block], fp32 global scale []), as
    ModelOpt's NVFP4 export makes them: the global scale maps the tensor's amax to 6 x 448, each block scale (e4m3,
    rounded to nearest) maps its block's amax to 6, and the codes round to nearest (ties to even)."""
    blocks = w.float().unflatten(-1, (-1, block))
    global_scale = (blocks.abs().amax() / (FP4_MAX * FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    scale = (blocks.abs().amax(-1, keepdim=True) / FP4_MAX / global_scale).clamp(max=FP8_MAX).to(torch.float8_e4m3fn)
    step = scale.float() * global_scale
    q = _round_e2m1(torch.where(step > 0, blocks / step, 0.0).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    return _pack_e2m1(q), scale.squeeze(-1), global_scale


def dequantize_nvfp4_weight(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:  # fmt: skip
    """int8 [.., out, in/2] packed e2m1 + e4m3 scale [.., out, in/16] + fp32 global scale (broadcast against the
    scale: [] or [.., 1, 1]) -> `dtype` [.., out, in]: code x fl32(scale x global scale), as the kernel forms it."""
    values = _unpack_e2m1(packed)
    return (values * _per_block(values, scale.float() * global_scale, "NVFP4")).to(dtype)


def simulate_kv_row_fp8(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8-round a KV row's nope channels as the cache stores them; RoPE channels stay as they are."""
    return torch.cat([fp8_simulate(kv[..., :-rope_dim], KV_FP8_BLOCK), kv[..., -rope_dim:]], dim=-1)


def simulate_index_fp4_reference(x: torch.Tensor) -> torch.Tensor:
    """Hadamard-rotate then FP4-round index queries / keys (the rotation spreads outliers before rounding)."""
    return fp4_simulate(hadamard_rotate(x), INDEX_FP4_BLOCK)


@triton.jit
def exact_ceil_log2(x):
    """ceil(log2(x)) of a positive normal fp32, from its bits, as `_pow2_ceil` gives it. scales.ceil_log2 floors x at
    1e-30, which the smallest scales here (all-zero blocks: tiny * qmax / qmax, or 1e-30 / 448 in the KV rows) are
    below."""
    bits = x.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def round_half_even(x):
    r = tl.floor(x + 0.5)
    return tl.where((r - x == 0.5) & (r % 2 != 0), r - 1.0, r)


@triton.jit
def fp4_round(x):
    """Nearest e2m1 value (ties to the even code) of |x| <= 6, sign kept: `_round_e2m1` in a kernel."""
    mag = tl.abs(x)
    q = tl.where(mag < 2.0, round_half_even(mag * 2.0) * 0.5,
                 tl.where(mag < 4.0, round_half_even(mag), round_half_even(mag * 0.5) * 2.0))  # fmt: skip
    q = tl.minimum(q, 6.0)
    return tl.where(x < 0, -q, q)


# One variant for any row count (see engine/kernels/moe.py) and positions at any offset (as in engine/kernels/rope.py).
@triton.jit(do_not_specialize=["n_rows"], do_not_specialize_on_alignment=["pos_ptr"])
def _index_fp4_kernel(
    x_ptr, out_ptr, n_rows, norm, stride_token, heads, pos_ptr, inv_freq_ptr, w_ptr, stride_w, w_out_ptr, w_scale,
    DIM: tl.constexpr, LOG2_DIM: tl.constexpr, BLOCK: tl.constexpr, FP4_TINY: tl.constexpr, ROWS: tl.constexpr,
    ROPE: tl.constexpr, FP4: tl.constexpr, WEIGHTS: tl.constexpr,
):  # fmt: skip
    """Rows of DIM channels, `heads` rows a token (token t's rows start at t * stride_token). With ROPE, the last
    ROPE channels first rotate by the token's position as the rope kernel rotates them (the index queries); with
    WEIGHTS, the token's head weights are cast to fp32 and scaled, one per row."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = rows < n_rows
    token, head = rows // heads, rows % heads
    c = tl.arange(0, DIM)
    mask = live[:, None]
    y = tl.load(x_ptr + (token.to(tl.int64) * stride_token + head * DIM)[:, None] + c[None, :], mask=mask, other=0.0)
    y = y.to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if ROPE > 0:  # interleaved pairs (2i, 2i + 1) of the last ROPE channels, rotated in fp32, back in x's dtype
        even, odd = tl.split(tl.reshape(y, (ROWS, DIM // 2, 2)))
        pair = tl.arange(0, DIM // 2)
        is_rope = pair >= (DIM - ROPE) // 2
        freq = tl.load(inv_freq_ptr + pair - (DIM - ROPE) // 2, mask=is_rope, other=0.0)
        angle = tl.load(pos_ptr + token, mask=live, other=0).to(tl.float32)[:, None] * freq[None, :]
        cos, sin = tl.cos(angle), tl.sin(angle)
        rot_even = tl.where(is_rope[None, :], (even * cos - odd * sin).to(dtype).to(tl.float32), even)
        rot_odd = tl.where(is_rope[None, :], (even * sin + odd * cos).to(dtype).to(tl.float32), odd)
        y = tl.reshape(tl.join(rot_even, rot_odd), (ROWS, DIM))
    if FP4:
        # hadamard_rotate's butterflies in registers, in its order, so that every sum rounds as there: pass i pairs
        # channel c with c + 2**i in each group of 2**(i + 1) channels and puts the sums first.
        for i in tl.static_range(LOG2_DIM):
            a, b = tl.split(tl.permute(tl.reshape(y, (ROWS, DIM >> (i + 1), 2, 1 << i)), (0, 1, 3, 2)))
            y = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), (ROWS, DIM))
        y = (y * norm).to(dtype).to(tl.float32)  # the rotation comes back in x's dtype
        # FP4 per BLOCK with a power-of-two scale; scaling by it is exact, so multiply by its inverse.
        blocks = tl.reshape(y, (ROWS, DIM // BLOCK, BLOCK))
        exponent = exact_ceil_log2(tl.div_rn(tl.maximum(tl.max(tl.abs(blocks), axis=2), FP4_TINY), 6.0))
        q = fp4_round(tl.minimum(tl.maximum(blocks * pow2(-exponent)[:, :, None], -6.0), 6.0))
        y = tl.reshape(q * pow2(exponent)[:, :, None], (ROWS, DIM))
    tl.store(out_ptr + rows[:, None].to(tl.int64) * DIM + c[None, :], y.to(dtype), mask=mask)
    if WEIGHTS:
        w = tl.load(w_ptr + token.to(tl.int64) * stride_w + head, mask=live, other=0.0).to(tl.float32)
        tl.store(w_out_ptr + rows, w * w_scale, mask=live)


def _index_rows_launch(x, heads, positions, inv_freq, weights, w_scale, fp4: bool):
    """x [tokens, heads * dim] (rows may be strided) -> out [tokens, heads, dim] in x's dtype, and the weights."""
    tokens, dim = x.shape[0], x.shape[1] // heads
    assert x.stride(1) == 1
    n_rows, block_rows = tokens * heads, 16
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device)
    w_out = torch.empty(tokens, heads, dtype=torch.float32, device=x.device) if weights is not None else None
    rope = 2 * inv_freq.shape[0] if inv_freq is not None else 0
    _index_fp4_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, out, n_rows, dim**-0.5, x.stride(0), heads, positions if rope else x, inv_freq if rope else x,
        weights if weights is not None else x, weights.stride(0) if weights is not None else 0,
        w_out if weights is not None else x, w_scale,
        DIM=dim, LOG2_DIM=dim.bit_length() - 1, BLOCK=INDEX_FP4_BLOCK,
        FP4_TINY=torch.finfo(torch.float32).tiny * FP4_MAX, ROWS=block_rows, ROPE=rope, FP4=fp4,
        WEIGHTS=weights is not None,
    )  # fmt: skip
    return out, w_out


def simulate_index_fp4_triton(x: torch.Tensor) -> torch.Tensor:
    """`simulate_index_fp4_reference` in one launch: x [..., dim] (dim a power of two, >= 32), fp32 / bf16."""
    x = x.contiguous()
    out, _ = _index_rows_launch(x.view(-1, x.shape[-1]), 1, None, None, None, 1.0, fp4=True)
    return out.view(x.shape)


def index_queries_reference(
    q: torch.Tensor,
    heads: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    weights: torch.Tensor,
    w_scale: float,
    quant_sim: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The lightning indexer's queries and head weights from their projections: q [N, heads * dim] -> RoPE at
    positions [N] -> (with quant_sim) Hadamard + FP4 -> [N, heads, dim]; weights [N, heads] -> fp32 * w_scale."""
    q = rope_reference(q.reshape(q.shape[0], heads, -1), positions, inv_freq)
    if quant_sim:
        q = simulate_index_fp4_reference(q)
    return q, weights.float() * w_scale


def index_queries_triton(q, heads, positions, inv_freq, weights, w_scale, quant_sim):
    """`index_queries_reference` in one launch."""
    return _index_rows_launch(q, heads, positions, inv_freq, weights, w_scale, fp4=quant_sim)


def index_queries(q, heads, positions, inv_freq, weights, w_scale, quant_sim):
    """The Triton kernel on CUDA, the reference elsewhere and for float64 (whose models round in float64)."""
    triton_ok = use_triton(q.device) and q.dtype != torch.float64
    impl = index_queries_triton if triton_ok else index_queries_reference
    return impl(q, heads, positions, inv_freq, weights, w_scale, quant_sim)


def simulate_index_fp4(x: torch.Tensor) -> torch.Tensor:
    """Hadamard-rotate then FP4-round index queries / keys: the Triton kernel on CUDA, the reference elsewhere and for
    float64 (whose models round in float64)."""
    if x.dtype == torch.float64 or not use_triton(x.device):
        return simulate_index_fp4_reference(x)
    return simulate_index_fp4_triton(x)
