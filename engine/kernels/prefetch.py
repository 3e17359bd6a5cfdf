"""Weights into L2 ahead of the GEMM that reads them. A decode step alternates weight-streaming GEMMs with stretches
of latency-bound kernels (norms, routing, the indexer, attention at one token) that leave the memory nearly idle.
One launch before such a stretch asks the copy engines of a few SMs (cp.async.bulk.prefetch, sm_90 on) to bring the
next GEMM's weights into L2, and returns: the transfers run beside the stretch, and the GEMM then reads L2.

A prefetch changes no value, so the plain-torch reference is to do nothing; GPUs before sm_90 do nothing too.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, use_triton

PREFETCH_CHUNK = 4096  # bytes a lane asks for: a program of 128 lanes covers 512 KB


@triton.jit
def prefetch_l2(ptrs, nbytes):
    """Each pointer's next `nbytes` bytes (16-aligned, a multiple of 16; 0 or less skips) into L2, holding no
    registers and not waiting for them."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_kernel(ptr, nbytes, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program i: bytes [i * LANES * CHUNK, +LANES * CHUNK) of the tensor at ptr, CHUNK a lane."""
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = (tl.minimum(nbytes - offs, CHUNK) // 16) * 16
    prefetch_l2(ptr.to(tl.pointer_type(tl.uint8)) + offs, size.to(tl.int32))


def prefetch_weights_triton(*tensors: torch.Tensor) -> None:
    """Ask for each tensor's bytes in L2 (one launch a tensor); returns before they arrive."""
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if nbytes and t.is_contiguous() and t.data_ptr() % 16 == 0:
            lanes = 128
            _prefetch_kernel[(triton.cdiv(nbytes, lanes * PREFETCH_CHUNK),)](
                t, nbytes, CHUNK=PREFETCH_CHUNK, LANES=lanes, num_warps=4
            )


def prefetch_weights_reference(*tensors: torch.Tensor) -> None:
    """Nothing: the values are the same whether or not they are in L2."""


def prefetch_weights(*tensors: torch.Tensor) -> None:
    """The Triton launch on sm_90 and later (not interpreted: it is PTX), the reference elsewhere."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if use_triton(device) and device.type == "cuda" and not interpreting() and (
        torch.cuda.get_device_capability(device) >= (9, 0)
    ):
        prefetch_weights_triton(*tensors)
    else:
        prefetch_weights_reference(*tensors)
