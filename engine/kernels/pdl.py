"""Programmatic dependent launch (sm_90 on): a kernel launched with it (`launch_pdl=True`) may start while the kernel
before it in the stream is still running, once every program of that one has started. Before `after_previous_grid`
it may only read what no kernel of the step writes (its weights): it can stream them into L2 while the kernel before
it, often latency-bound (a norm, attention at one token), leaves the memory idle. After it, the previous kernel's
writes are visible and its reads done. Every kernel launched with PDL must call after_previous_grid before it reads
its inputs or writes anything: the guarantee then chains through the stream, one kernel to the next.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from engine.kernels.dispatch import interpreting


def pdl_supported(device: torch.device) -> bool:
    """Hopper and later GPUs; not the interpreter, which runs no PTX."""
    return device.type == "cuda" and not interpreting() and torch.cuda.get_device_capability(device) >= (9, 0)


@triton.jit
def after_previous_grid(PDL: tl.constexpr):
    """Waits until the kernel before this one has finished (its writes visible), then lets the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()
