"""Block quantisation of the official DeepSeek-V4 checkpoint formats (reference §9, §11.2).

- FP8 e4m3 with power-of-two (ue8m0) block scales: weights in 128x128 blocks, activations / KV rows per 64 or 128
  along the last dimension.
- FP4 e2m1 (MXFP4) with ue8m0 scales per 32 along the last dimension; two codes per byte, low nibble = even element.

`*_simulate` functions round-trip a tensor through the format in place of the real low-precision storage, as the
official inference code does for its quantisation-aware-trained activations (`EngineConfig.quant_sim`).
"""

from __future__ import annotations

import math

import torch

FP8_MAX = 448.0
FP4_MAX = 6.0
KV_FP8_BLOCK = 64  # the nope channels of a KV row carry one ue8m0 scale per 64 (the 584-byte row)
INDEX_FP4_BLOCK = 32
# The eight magnitudes of e2m1; bit 3 of a code is the sign.
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x: a scale that ue8m0 (exponent-only) represents exactly."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def _block_scales(blocks: torch.Tensor, qmax: float) -> torch.Tensor:
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
    scale = _block_scales(blocks, FP8_MAX)
    q = (blocks / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(blocks.dtype)
    return (q * scale).reshape(shape).to(dtype)


def fp4_simulate(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Round-trip `x` through e2m1 with one ue8m0 scale per `block` elements of the last dimension."""
    shape, dtype = x.shape, x.dtype
    blocks = _working(x).unflatten(-1, (-1, block))
    scale = _block_scales(blocks, FP4_MAX)
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


def _e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
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
    scale = _block_scales(tiles, FP8_MAX)  # [rows, cols, 1]
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
    s = _e8m0_to_float(scale).repeat_interleave(block, 0).repeat_interleave(block, 1)[:out_f, :in_f]
    return (w.float() * s).to(dtype)


def quantize_fp4_weight(w: torch.Tensor, block: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, in/2] packed e2m1 codes, low nibble = even element; ue8m0 scale [out, in/block])."""
    blocks = w.float().unflatten(-1, (-1, block))
    scale = _block_scales(blocks, FP4_MAX)
    q = _round_e2m1((blocks / scale).clamp(-FP4_MAX, FP4_MAX)).flatten(-2)
    codes = torch.bucketize(q.abs(), E2M1_VALUES.to(w.device)).to(torch.uint8) | ((q < 0).to(torch.uint8) << 3)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), _e8m0(scale.squeeze(-1))


def dequantize_fp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """int8 [out, in/2] packed e2m1 + ue8m0 scale [out, in/32] -> `dtype` [out, in]."""
    raw = packed.view(torch.uint8)
    codes = torch.stack([raw & 0x0F, raw >> 4], dim=-1).flatten(-2).long()
    values = E2M1_VALUES.to(packed.device)[codes & 7]
    values = torch.where(codes >= 8, -values, values)
    block = values.shape[-1] // scale.shape[-1]
    if scale.shape[-1] * block != values.shape[-1]:
        raise ValueError(f"FP4 scale shape {tuple(scale.shape)} does not fit packed weight {tuple(packed.shape)}")
    return (values * _e8m0_to_float(scale).repeat_interleave(block, -1)).to(dtype)


def simulate_kv_row_fp8(kv: torch.Tensor, rope_dim: int) -> torch.Tensor:
    """FP8-round a KV row's nope channels as the cache stores them; RoPE channels stay as they are."""
    return torch.cat([fp8_simulate(kv[..., :-rope_dim], KV_FP8_BLOCK), kv[..., -rope_dim:]], dim=-1)


def simulate_index_fp4(x: torch.Tensor) -> torch.Tensor:
    """Hadamard-rotate then FP4-round index queries / keys (the rotation spreads outliers before rounding)."""
    return fp4_simulate(hadamard_rotate(x), INDEX_FP4_BLOCK)
