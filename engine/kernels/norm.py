"""RMSNorm (reference §3): y = w * x / rms(x) in fp32, the weight kept in fp32, the output in x's dtype.

Plain torch spends about ten element-wise launches on it (casts, square, mean, add, rsqrt, two products); the
Triton kernel is one, a row per program on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, use_triton


def tile_elements() -> int:
    """Elements one program works on: small on the GPU (registers, and enough programs at decode batch sizes); large
    in the interpreter, which pays per program."""
    return 1 << 20 if interpreting() else 4096


def rows_per_program(rows: int, width: int) -> int:
    return max(1, min(triton.next_power_of_2(rows), tile_elements() // triton.next_power_of_2(width)))


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension, without a weight (per-head q norm, mHC input scale)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] -> weight * x / rms(x), computed in fp32, returned in x's dtype."""
    return (weight * rms_normalize(x.float(), eps)).to(x.dtype)


@triton.jit(do_not_specialize=["rows"])  # one variant for any row count (see engine/kernels/moe.py)
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, rows, stride_x, eps, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr
):
    row = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    mask = (row[:, None] < rows) & (d[None, :] < D)
    offs = row[:, None].to(tl.int64) * D + d[None, :]
    x = tl.load(x_ptr + row[:, None].to(tl.int64) * stride_x + d[None, :], mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    y = tl.load(w_ptr + d, mask=d < D, other=0.0)[None, :] * (x * inv_rms[:, None])
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x's rows may be strided (a column slice of a fused projection's output); the output is contiguous."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    block_m = rows_per_program(rows.shape[0], dim)
    _rms_norm_kernel[(triton.cdiv(rows.shape[0], block_m),)](
        rows, weight, out, rows.shape[0], rows.stride(0), eps,
        D=dim, BLOCK_M=block_m, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    impl = rms_norm_triton if use_triton(x.device) else rms_norm_reference
    return impl(x, weight, eps)
