"""The FP8 / FP4 formats of the official checkpoint and ModelOpt's NVFP4, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import MainRows
from engine.kernels.quant import (
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    dequantize_nvfp4_weight,
    fp4_simulate,
    fp8_simulate,
    hadamard_rotate,
    quantize_fp4_weight,
    quantize_fp8_weight,
    quantize_nvfp4_weight,
    simulate_kv_row_fp8,
)


def test_fp4_packing_low_nibble_is_the_even_element_and_bit3_the_sign():
    w = torch.tensor([[0.5, -6.0] + [0.0] * 30])  # block max 6 -> scale 1
    packed, scale = quantize_fp4_weight(w)
    assert packed.view(torch.uint8)[0, 0].item() == (0x1 | (0xF << 4))  # 0.5 = code 1; -6 = sign | code 7
    assert scale.view(torch.uint8)[0, 0].item() == 127  # 2^0
    assert torch.equal(dequantize_fp4_weight(packed, scale), w)


def test_nvfp4_as_modelopt_makes_it_global_scale_e4m3_block_scales_and_codes():
    """amax 6 x 448 x 2**-4 -> global scale 2**-4; a block of max 3 -> e4m3 scale 3/6 / 2**-4 = 8; a zero block -> 0."""
    w = torch.zeros(1, 48)
    w[0, :2] = torch.tensor([6 * 448 * 2**-4, -0.5 * 448 * 2**-4])  # block 0: max at the top code, 0.5 scaled
    w[0, 16:18] = torch.tensor([3.0, -1.5])
    packed, scale, global_scale = quantize_nvfp4_weight(w)
    assert global_scale.item() == 2**-4 and scale.dtype == torch.float8_e4m3fn and scale.shape == (1, 3)
    assert scale.float().tolist() == [[448.0, 8.0, 0.0]]
    assert packed.view(torch.uint8)[0, 0].item() == (0x7 | (0x9 << 4))  # 6 = code 7; -0.5 = sign | code 1
    assert torch.equal(dequantize_nvfp4_weight(packed, scale, global_scale), w)
    assert dequantize_nvfp4_weight(packed, scale, global_scale, torch.bfloat16).dtype == torch.bfloat16


def test_fp4_rounds_to_nearest_with_ties_to_even_codes():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] + [0.0] * 24])  # midpoints, scale 1
    # Ties go to the even code: 0.25->0 (code 0), 0.75->1.0 (2), 1.25->1.0 (2), 1.75->2 (4), 2.5->2 (4),
    # 3.5->4 (6), 5->4 (6).
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(fp4_simulate(x)[0, :8], expected)


def test_fp8_simulation_uses_a_power_of_two_scale_per_block():
    x = torch.tensor([[1.0, 300.0, -0.1, 3.0] + [0.0] * 60, [1000.0] + [0.0] * 63])
    y = fp8_simulate(x, 64)
    # Block 0 max 300 -> scale 1 (300/448 <= 1): values rounded on e4m3's own grid.
    assert y[0, 0].item() == 1.0 and y[0, 1].item() == 288.0 and y[0, 3].item() == 3.0
    # Block 1 max 1000 -> scale 4: 1000/4 = 250 -> e4m3 256 -> 1024.
    assert y[1, 0].item() == 1024.0


def test_fp8_weight_blocks_are_128x128_with_partial_edges():
    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    q, scale = quantize_fp8_weight(w)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (3, 2)
    restored = dequantize_fp8_weight(q, scale)
    assert ((restored - w).abs() <= w.abs() / 16 + 1e-3).all()


def test_hadamard_is_orthonormal_and_self_inverse():
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(1))
    y = hadamard_rotate(x)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-4)
    assert torch.allclose(hadamard_rotate(y), x, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_rows_store_the_kv_simulation_exactly(dtype):
    """The decode path writes KV rows to FP8 storage without simulating their FP8 rounding first: a row that is
    already simulated must store the same values as the raw row (its scale may come out one power of two smaller,
    with every code doubled, which reads back the same)."""
    gen = torch.Generator().manual_seed(5)
    rows = (torch.randn(40, 512, generator=gen) * torch.logspace(-6, 3, 40)[:, None]).to(dtype)
    rows[3, :64] = 0  # an all-zero scale block
    raw, simulated = (MainRows(1, 64, 512, 64, "fp8_e4m3", "cpu") for _ in range(2))
    raw.write(torch.arange(40), rows)
    simulated.write(torch.arange(40), simulate_kv_row_fp8(rows, 64))
    assert torch.equal(raw.read(torch.arange(40)), simulated.read(torch.arange(40)))
