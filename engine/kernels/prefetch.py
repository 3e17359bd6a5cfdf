"""Weights into L2 ahead of the GEMM that reads them. A decode step alternates weight-streaming GEMMs with stretches
of latency-bound kernels (norms, mHC, routing, the indexer, attention at one token) that leave the memory nearly
idle. One launch before such a stretch asks the copy engines of a few SMs (cp.async.bulk.prefetch, sm_90 on) for
the next GEMM's weights in L2 and returns: the transfers run beside the stretch, and the GEMM then reads L2.

A prefetch changes no value, so the plain-torch reference does nothing; so do GPUs before sm_90.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, use_triton

CHUNK = 4096  # bytes a lane asks for
LANES = 128  # lanes a program: 512 KB


@triton.jit
def _prefetch_l2(ptrs, nbytes):
    """Each pointer's next `nbytes` bytes (16-aligned, a multiple of 16; 0 or less skips) into L2, holding no
    registers and not waiting for them."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [ptrs, nbytes], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_kernel(base_ptr, table_ptr, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program (i, t): bytes [i * LANES * CHUNK, +LANES * CHUNK) of tensor t, which starts table[t, 0] bytes from
    base and holds table[t, 1]."""
    t = tl.program_id(1)
    start, nbytes = tl.load(table_ptr + 2 * t), tl.load(table_ptr + 2 * t + 1)
    offs = (tl.program_id(0) * LANES + tl.arange(0, LANES)).to(tl.int64) * CHUNK
    size = (tl.minimum(nbytes - offs, CHUNK) // 16) * 16
    _prefetch_l2(base_ptr + start + offs, size.to(tl.int32))


class L2PrefetchTriton:
    """One launch for all of `tensors` (their addresses fixed when made: weights, which do not move)."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        whole = [t for t in tensors if t.numel() and t.is_contiguous() and t.data_ptr() % 16 == 0]
        self.base = whole[0].view(-1).view(torch.uint8)
        rows = [(t.data_ptr() - self.base.data_ptr(), t.numel() * t.element_size()) for t in whole]
        self.table = torch.tensor(rows, dtype=torch.int64).to(self.base.device)
        self.grid = (triton.cdiv(max(n for _, n in rows), LANES * CHUNK), len(rows))

    def __call__(self) -> None:
        _prefetch_kernel[self.grid](self.base, self.table, CHUNK=CHUNK, LANES=LANES, num_warps=4)


def l2_prefetch_reference(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """Nothing to do: the values are the same whether or not they are in L2."""
    return lambda: None


def l2_prefetch(tensors: Sequence[torch.Tensor]) -> Callable[[], None]:
    """A call that asks for `tensors` in L2: the Triton launch on sm_90 and later (not interpreted: it is PTX), the
    reference elsewhere. Make it outside a CUDA graph capture (its address table is copied to the GPU)."""
    device = tensors[0].device if tensors else torch.device("cpu")
    if (use_triton(device) and device.type == "cuda" and not interpreting()
            and torch.cuda.get_device_capability(device) >= (9, 0)):  # fmt: skip
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("an L2 prefetch's table is made by an eager call before any CUDA graph is captured")
        return L2PrefetchTriton(tensors)
    return l2_prefetch_reference(tensors)
