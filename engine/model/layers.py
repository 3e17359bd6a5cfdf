"""Small building blocks: RMSNorm, DeepSeek-V4's interleaved partial RoPE with YaRN (reference §5.1), and fused
projections (linears that read the same input as one GEMM)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.norm import rms_norm
from engine.kernels.rope import rope
from engine.model.args import YarnScaling


class RMSNorm(nn.Module):
    """y = w * x / rms(x), in fp32; the weight is kept in fp32 whatever the model dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rope_inv_freq(rope_dim: int, theta: float, yarn: YarnScaling | None) -> torch.Tensor:
    """One frequency per rotated pair; with YaRN, low frequencies are divided by the factor along a linear ramp."""
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    if yarn is None:
        return freqs

    def correction_dim(rotations: float) -> float:
        return (
            rope_dim
            * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


class Rotary(nn.Module):
    """Rotates the last `rope_dim` channels in interleaved pairs (2i, 2i+1), GPT-J style, at given positions."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None):
        super().__init__()
        self.rope_dim = rope_dim
        self.register_buffer("inv_freq", rope_inv_freq(rope_dim, theta, yarn), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x: [N, ..., D] with positions [N]; returns a new tensor, rope channels rotated (or un-rotated)."""
        return rope(x, positions, self.inv_freq, inverse)


class FusedLinear:
    """Bias-free linears that read the same input, as one GEMM: their weights concatenated along the output
    dimension into one tensor, each member's parameter a view of its rows. Calling it returns each member's output,
    column slices of the one product."""

    def __init__(self, linears: list[nn.Linear]):
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        with torch.no_grad():
            self.weight = torch.cat([linear.weight.detach() for linear in linears])
            offset = 0
            for linear, size in zip(linears, self.sizes, strict=True):
                linear.weight.data = self.weight[offset : offset + size]
                offset += size

    def intact(self) -> bool:
        """Whether every member's parameter is still a view of the fused weight (a cast or a move replaces it)."""
        base, step, offset = self.weight.data_ptr(), self.weight.stride(0) * self.weight.element_size(), 0
        for linear, size in zip(self.linears, self.sizes, strict=True):
            w = linear.weight
            if w.dtype != self.weight.dtype or w.device != self.weight.device or w.data_ptr() != base + offset * step:
                return False
            offset += size
        return True

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        # A float64 model (tests) runs its fp32 groups in float64 too, so its results do not depend on chunking.
        return list(F.linear(x, self.weight.to(x.dtype)).split(self.sizes, dim=-1))
