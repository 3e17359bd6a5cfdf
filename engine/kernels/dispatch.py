"""Picks an operation's implementation: the Triton kernel on CUDA, the plain-torch reference elsewhere.

`FLASHGATE_KERNELS=triton` forces the Triton kernels (with TRITON_INTERPRET=1 they run on the CPU, which is how CI
tests them); `FLASHGATE_KERNELS=torch` forces the references.
"""

from __future__ import annotations

import os

import torch


def use_triton(device: torch.device) -> bool:
    choice = os.environ.get("FLASHGATE_KERNELS", "auto")
    if choice not in ("auto", "triton", "torch"):
        raise ValueError(f"FLASHGATE_KERNELS must be auto, triton or torch, got {choice!r}")
    if choice == "auto":
        return device.type == "cuda"
    return choice == "triton"


def interpreting() -> bool:
    """Triton's CPU interpreter runs the kernels; its bf16 tl.dot is wrong (as of Triton 3.6), so kernels upcast dot
    operands to fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"
