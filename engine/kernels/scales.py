"""Power-of-two (ue8m0) scales inside Triton kernels, computed from the float's bits: the GPU's log2 and exp2 are
approximate, and a scale off by one ulp would stop matching the plain-torch references."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def ceil_log2(x):
    """ceil(log2(x)) of a positive normal fp32."""
    bits = tl.maximum(x, 1e-30).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def pow2(e):
    """2**e for an integer exponent."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_ceil(x):
    """The smallest power of two >= x."""
    return pow2(ceil_log2(x))
