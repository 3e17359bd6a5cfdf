"""The FP8 block-scaled linears (engine/kernels/fp8_gemm.py) against their plain-torch references under Triton's
interpreter, at small sizes: the activation quantization bit for bit (partial K blocks, all-zero blocks, extreme
magnitudes), the decode kernel (with and without split K, quantizing in its programs and, past 16 tokens, first) and
the prefill kernel for ue8m0 and fp32 weight scales, K and N not multiples of 128, extreme weight scales, the grouped
`wo_a` form; and the reference against a dequantize-then-matmul oracle. tests/gpu/test_quant_kernels_gpu.py runs them
at V4-Flash shapes."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp8_gemm import (
    fp8_block_grouped_linear_reference,
    fp8_block_grouped_linear_triton,
    fp8_block_linear_reference,
    fp8_block_linear_triton,
    quantize_activations_reference,
    quantize_activations_triton,
)
from engine.kernels.quant import dequantize_fp8_weight, quantize_fp8_weight
from engine.kernels.split_k import tile_counters

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")


def _weight(n: int, k: int, gen: torch.Generator, fp32_scale: bool = False):
    q, scale = quantize_fp8_weight(torch.randn(n, k, generator=gen) * 0.05)
    return q, scale.float() if fp32_scale else scale


def _assert_fp32_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The same exact products and scales; only the order of fp32 sums within a block differs."""
    assert got.dtype == torch.float32 and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_activation_quantization_is_bit_exact(dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 300, generator=gen) * torch.logspace(-20, 20, 40)[:, None]  # rows 1e-20 .. 1e20
    x[3, :128] = 0.0  # an all-zero block
    x[5, 256:] = 0.0  # an all-zero partial block
    x[7, 10] = 3e38  # beside the largest finite values
    x = x.to(dtype)
    codes, scale = quantize_activations_triton(x)
    ref_codes, ref_scale = quantize_activations_reference(x)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))
    assert torch.equal(scale, ref_scale)
    assert scale.isfinite().all() and (scale > 0).all()
    assert (codes[3, :128].float() == 0).all()


@pytest.mark.parametrize("fp32_scale", [False, True], ids=["e8m0", "fp32"])
@pytest.mark.parametrize(
    ("m", "splits"),
    [(3, None), (3, 3), (20, None), (20, 3), (70, None)],
    ids=["decode", "split-k", "decode-quantized-first", "split-k-quantized-first", "prefill"],
)
def test_linear_matches_reference(m, splits, fp32_scale):
    """K = 300 and N = 200: partial blocks on both axes."""
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, 300, generator=gen)
    weight, scale = _weight(200, 300, gen, fp32_scale)
    ref = fp8_block_linear_reference(x, weight, scale, torch.float32)
    launch = {"splits": splits} if splits else {}
    _assert_fp32_close(fp8_block_linear_triton(x, weight, scale, torch.float32, **launch), ref)
    assert not tile_counters(x.device, 1).any()  # a split launch's last programs leave its counters at zero
    got = fp8_block_linear_triton(x.bfloat16(), weight, scale)  # bf16 in, bf16 out (x's dtype)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, fp8_block_linear_reference(x.bfloat16(), weight, scale), rtol=8e-3, atol=1e-3)


@pytest.mark.parametrize("m", [2, 70], ids=["decode", "prefill"])
def test_zero_blocks_and_extreme_scales(m):
    """Weight blocks all zero (their scale quantize gives: the tiny floor), ue8m0 scales from 2**-127 (byte 0) to
    2**60 beside ordinary ones, and all-zero activation blocks: finite, and as the reference."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(m, 384, generator=gen)
    x[:, 128:256] = 0.0
    weight, scale = _weight(256, 384, gen)
    weight[:128, :128] = 0.0
    raw = scale.view(torch.uint8).clone()
    raw[0, 0] = 0  # 2**-127 over an all-zero weight block
    raw[0, 2], raw[1, 0], raw[1, 1] = 127 + 60, 1, 127 - 100
    scale = raw.view(torch.float8_e8m0fnu)
    ref = fp8_block_linear_reference(x, weight, scale, torch.float32)
    got = fp8_block_linear_triton(x, weight, scale, torch.float32)
    assert got.isfinite().all()
    _assert_fp32_close(got, ref)


@pytest.mark.parametrize("n", [5, 20, 70], ids=["decode", "decode-quantized-first", "prefill"])
def test_grouped_linear_matches_reference(n):
    """wo_a's form: 3 groups of 128 rows, D = 320 (a partial block)."""
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, 320, generator=gen)
    weight, scale = _weight(3 * 128, 320, gen)
    ref = fp8_block_grouped_linear_reference(x, weight, scale, torch.float32)
    assert ref.shape == (n, 3, 128)
    for g in range(3):  # each group is a plain block linear of its own rows
        alone = fp8_block_linear_reference(x[:, g], weight[g * 128 : (g + 1) * 128], scale[g : g + 1], torch.float32)
        assert torch.equal(ref[:, g], alone)
    _assert_fp32_close(fp8_block_grouped_linear_triton(x, weight, scale, torch.float32), ref)


@pytest.mark.parametrize("fp32_scale", [False, True], ids=["e8m0", "fp32"])
def test_reference_against_dequantize_then_matmul(fp32_scale):
    """The reference is the float64 product of the dequantized activations and weight to within fp32 accumulation
    (1e-6 relative), and the product of the unquantized activations with the dequantized weight to within e4m3
    activation rounding (3 mantissa bits: seen 2.7% relative, bound 5%)."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(6, 300, generator=gen)
    weight, scale = _weight(200, 300, gen, fp32_scale)
    ref = fp8_block_linear_reference(x, weight, scale, torch.float32).double()
    w = dequantize_fp8_weight(weight, scale, torch.float64)
    codes, act_scale = quantize_activations_reference(x)
    activations = codes.double() * act_scale.double().repeat_interleave(128, 1)[:, :300]
    exact = activations @ w.T
    assert (ref - exact).norm() <= 1e-6 * exact.norm()
    plain = x.double() @ w.T
    assert (ref - plain).norm() <= 5e-2 * plain.norm()
