"""DeepSeek-V4's RoPE (reference §5.1): the last `rope_dim` channels rotate in interleaved pairs (2i, 2i+1).

Plain torch spends about fifteen launches on one rotation (angles, cos, sin, slices, products, stack, cast, cat),
about twenty with q's per-head RMS norm before it. The Triton kernel is one launch, and takes that step too:
the q norm (`rms_rope`), or the cast of the attention output to the model dtype before it is rotated back
(`rope(..., inverse=True, dtype=)`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import use_triton
from engine.kernels.norm import rms_normalize, rows_per_program


def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [N, rope_dim / 2] of positions [N] times each pair's frequency, in fp32."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, ..., D]; cos, sin [N, rope_dim / 2] -> a new tensor with the last rope_dim channels rotated in fp32."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    # split and unbind, not slices: their backward is one concatenation, a slice's a zero tensor of x (training)
    nope, rope = x.split([x.shape[-1] - rope_dim, rope_dim], dim=-1)
    even, odd = rope.float().unflatten(-1, (-1, 2)).unbind(-1)
    rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def rope_reference(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """x [N, ..., D] cast to `dtype` (default its own), its last 2 * len(inv_freq) channels rotated by
    positions [N] (or back, with inverse)."""
    cos, sin = rope_angles(positions, inv_freq)
    return rotate_interleaved(x.to(dtype or x.dtype), cos, -sin if inverse else sin)


def rms_rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    """The q path: each head of x [N, H, D] divided by its rms (in x's dtype), then rotated by positions [N]."""
    cos, sin = rope_angles(positions, inv_freq)
    return rotate_interleaved(rms_normalize(x, eps), cos, sin)


# One variant for any row count (see engine/kernels/moe.py), and for positions at any offset (a step's positions share
# one upload with its other host data); each row loads its own position.
@triton.jit(do_not_specialize=["rows"], do_not_specialize_on_alignment=["pos_ptr"])
def _rope_kernel(
    x_ptr, pos_ptr, inv_freq_ptr, out_ptr, rows, rows_per_token, stride_token, eps,
    D: tl.constexpr, ROPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    NORMALIZE: tl.constexpr, INVERSE: tl.constexpr,
):  # fmt: skip
    """Rows of D channels, loaded and stored whole and split into even / odd pairs in registers (strided loads of
    each half take twice as long); rows_per_token rows share a position."""
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    col = tl.arange(0, BLOCK_D)
    live = row < rows
    mask = live[:, None] & (col[None, :] < D)
    token, within = (row // rows_per_token).to(tl.int64), row % rows_per_token
    x = tl.load(x_ptr + (token * stride_token + within * D)[:, None] + col[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    if NORMALIZE:  # as rms_normalize: the fp32 1/rms is rounded to x's dtype, and so is the product
        xf = x.to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=1) / D + eps).to(dtype).to(tl.float32)[:, None]
        x = (xf * inv_rms).to(dtype)
    else:
        x = x.to(dtype)
    even, odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_D // 2, 2)))
    pair = tl.arange(0, BLOCK_D // 2)
    first_rope_pair: tl.constexpr = (D - ROPE) // 2
    is_rope = (pair >= first_rope_pair) & (pair < D // 2)
    freq = tl.load(inv_freq_ptr + pair - first_rope_pair, mask=is_rope, other=0.0)
    position = tl.load(pos_ptr + row // rows_per_token, mask=live, other=0).to(tl.float32)
    angle = position[:, None] * freq[None, :]
    cos, sin = tl.cos(angle), tl.sin(angle)
    if INVERSE:
        sin = -sin
    e, o = even.to(tl.float32), odd.to(tl.float32)
    even = tl.where(is_rope[None, :], (e * cos - o * sin).to(dtype), even)
    odd = tl.where(is_rope[None, :], (e * sin + o * cos).to(dtype), odd)
    y = tl.reshape(tl.join(even, odd), (BLOCK_M, BLOCK_D))
    tl.store(out_ptr + row[:, None].to(tl.int64) * D + col[None, :], y, mask=mask)


def _rope_launch(x, positions, inv_freq, eps, dtype, normalize: bool, inverse: bool) -> torch.Tensor:
    """x [N, ..., D]: each token's rows contiguous, tokens at any stride (a column slice of a fused projection)."""
    dim, tokens = x.shape[-1], x.shape[0]
    if not x[:1].is_contiguous():
        x = x.contiguous()
    n_rows = x.numel() // dim
    out = torch.empty(n_rows, dim, dtype=dtype, device=x.device)
    # Half a tile of rows: the split into pairs and the join back hold each row twice.
    block_m = max(1, rows_per_program(n_rows, dim) // 2)
    _rope_kernel[(triton.cdiv(n_rows, block_m),)](
        x, positions, inv_freq, out, n_rows, n_rows // max(tokens, 1), x.stride(0) if x.dim() > 1 else dim, eps,
        D=dim, ROPE=2 * inv_freq.shape[0], BLOCK_M=block_m, BLOCK_D=max(2, triton.next_power_of_2(dim)),
        NORMALIZE=normalize, INVERSE=inverse,
    )  # fmt: skip
    return out.view(x.shape)


def rope_triton(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _rope_launch(x, positions, inv_freq, 0.0, dtype or x.dtype, normalize=False, inverse=inverse)


def rms_rope_triton(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    return _rope_launch(x, positions, inv_freq, eps, x.dtype, normalize=True, inverse=False)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    inverse: bool = False,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    impl = rope_triton if use_triton(x.device) else rope_reference
    return impl(x, positions, inv_freq, inverse, dtype)


def rms_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, eps: float) -> torch.Tensor:
    impl = rms_rope_triton if use_triton(x.device) else rms_rope_reference
    return impl(x, positions, inv_freq, eps)
