"""Picks an operation's implementation: the Triton kernel on CUDA, the plain-torch reference elsewhere.

`FLASHGATE_KERNELS=triton` forces the Triton kernels (with TRITON_INTERPRET=1 they run on the CPU, which is how CI
tests them); `FLASHGATE_KERNELS=torch` forces the references. `FLASHGATE_KERNELS=autograd` (training) is the
references too, except for the few Triton kernels with a backward, which run on CUDA (`use_autograd_triton`).
"""

from __future__ import annotations

import os

import torch


def use_triton(device: torch.device) -> bool:
    choice = os.environ.get("FLASHGATE_KERNELS", "auto")
    if choice not in ("auto", "triton", "torch", "autograd"):
        raise ValueError(f"FLASHGATE_KERNELS must be auto, triton, torch or autograd, got {choice!r}")
    if choice == "auto":
        return device.type == "cuda"
    return choice == "triton"


def use_autograd_triton(device: torch.device) -> bool:
    """Whether a reference's differentiable Triton kernel replaces its plain torch: under FLASHGATE_KERNELS=autograd,
    on CUDA, where a training step's many small reference launches are the host's work (elsewhere the references)."""
    return os.environ.get("FLASHGATE_KERNELS") == "autograd" and device.type == "cuda"


def interpreting() -> bool:
    """Triton's CPU interpreter runs the kernels; its bf16 tl.dot is wrong (as of Triton 3.6), so kernels upcast dot
    operands to fp32 there."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def wide(t: torch.Tensor) -> torch.Tensor:
    """The precision a plain-torch reference computes in: fp32, or the tensor's own when wider (a float64 model then
    rounds nowhere to fp32, so its results do not depend on how its tokens were chunked)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# Plain GEMMs of up to this many rows run at their own row count (decode batches, each captured in its CUDA graph).
GEMM_EXACT_ROWS = 64


def gemm_rows(n: int) -> int:
    """The rows a plain (cuBLAS) GEMM of n rows runs at on CUDA: n up to GEMM_EXACT_ROWS, else n rounded up to one
    of 8 sizes an octave (at most 1/8 more rows). cuBLAS chooses its kernel on the host for each new shape, ~4-5 ms
    on the H200 (torch 2.11, CUDA 13) while the GPU waits — up to three times a prefill step of a new length on the
    bench model; a few sizes keep its choices cached, and the boot warm-up meets each (engine/boot.py)."""
    if n <= GEMM_EXACT_ROWS:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def at_gemm_rows(gemm, x: torch.Tensor) -> torch.Tensor:
    """gemm(x) with x's rows (dim 0) padded with zero rows to gemm_rows(len(x)) on CUDA, whose outputs are dropped.
    Zeros, not whatever memory held: a backward pass (the demo model's training) sums every row into the weight's
    gradient, each padding row times a zero gradient, and NaN or inf there would make it NaN."""
    n = len(x)
    rows = gemm_rows(n) if x.is_cuda else n
    if rows == n:
        return gemm(x)
    padded = x.new_zeros((rows, *x.shape[1:]))
    padded[:n] = x
    return gemm(padded)[:n]


def multiprocessors(device: torch.device) -> int:
    """The GPU's streaming multiprocessors (16 stand in on the CPU, so the interpreter meets split launches too)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 16


def splits_for(batch: int, device: torch.device, waves: int = 4, cap: int = 1024) -> int:
    """Programs per request so that a grid of (batch, splits) fills the GPU `waves` times over. It depends only on
    the batch size, so a CUDA graph captured for a batch size keeps its grid."""
    if device.type != "cuda":
        return 4
    return max(1, min(cap, waves * multiprocessors(device) // batch))


def shared_memory_limit(device: torch.device) -> int:
    """Bytes of shared memory a block may use on `device` (227 KB on an H100/H200, 99 KB on Ada and consumer
    Blackwell GPUs)."""
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
