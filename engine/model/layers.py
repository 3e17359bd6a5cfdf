"""Small building blocks: RMSNorm and DeepSeek-V4's interleaved partial RoPE with YaRN (reference §5.1)."""

from __future__ import annotations

import math

import torch
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
