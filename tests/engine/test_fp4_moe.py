"""The FP4 routed-expert grouped GEMM (engine/kernels/fp4_moe.py), MXFP4 and NVFP4, against its plain-torch reference
under Triton's interpreter, at small sizes: fp32 and bf16 activations, one token and several, odd expert counts,
experts with no pairs, every pair on one expert (blocks of pairs looped), all-zero and extreme scales, int8 and uint8
codes; and the reference against dequantize-then-matmul in float64. tests/gpu/test_quant_kernels_gpu.py runs it at
V4-Flash sizes."""

from __future__ import annotations

import types
from unittest import mock

import pytest
import torch

from engine.kernels.fp4_moe import (
    LARGE_TILES,
    PackedFp4,
    expert_tiles,
    moe_expert_pairs_fp4_reference,
    moe_expert_pairs_fp4_triton,
)
from engine.kernels.moe import moe_expert_pairs_reference
from engine.kernels.quant import quantize_fp4_weight, quantize_nvfp4_weight
from engine.kernels.split_k import tile_counters

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

K, D, INTER, LIMIT = 3, 64, 64, 1.0  # a limit of 1 makes the SwiGLU clamp bite


def _packed(*shape, gen: torch.Generator, layout: str) -> PackedFp4:
    """Random [E, out, in] quantized per expert to MXFP4 (int8 codes [E, out, in/2], ue8m0 scales [E, out, in/32])
    or NVFP4 (uint8 codes, e4m3 scales [E, out, in/16], global scales [E])."""
    w = torch.randn(*shape, generator=gen) * shape[-1] ** -0.5 * 2
    if layout == "mxfp4":
        codes, scale = quantize_fp4_weight(w.reshape(-1, shape[-1]))
        return PackedFp4(codes.view(*shape[:-1], -1), scale.view(*shape[:-1], -1))
    codes, scales, globals_ = zip(*(quantize_nvfp4_weight(expert) for expert in w), strict=True)
    return PackedFp4(torch.stack(codes).view(torch.uint8), torch.stack(scales), torch.stack(globals_))


def _experts(n_experts: int, gen: torch.Generator, layout: str = "mxfp4") -> tuple[PackedFp4, PackedFp4, PackedFp4]:
    return (_packed(n_experts, INTER, D, gen=gen, layout=layout), _packed(n_experts, INTER, D, gen=gen, layout=layout),
            _packed(n_experts, D, INTER, gen=gen, layout=layout))  # fmt: skip


def _routing(n: int, n_experts: int, gen: torch.Generator):
    ids = torch.stack([torch.randperm(n_experts, generator=gen)[:K] for _ in range(n)])
    return torch.rand(n, K, generator=gen) + 0.2, ids


def _assert_matches(x, weights, ids, experts, **launch):
    touched, ref_touched = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    ref = moe_expert_pairs_fp4_reference(x, weights, ids, *experts, LIMIT, ref_touched)
    got = moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT, touched, block_k=32, **launch)
    assert got.dtype == x.dtype and got.shape == (ids.numel(), D) and got.isfinite().all()
    assert touched.item() == ref_touched.item() == len(torch.unique(ids))
    if x.dtype == torch.float32:  # exact weights either way: only the fp32 sums' order differs
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    else:  # the kernel keeps gate/up in fp32 where the reference rounds them to bf16 (as the bf16 path)
        torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=2e-2)


LAYOUTS = pytest.mark.parametrize("layout", ["mxfp4", "nvfp4"])


@LAYOUTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "n_experts"), [(1, 5), (9, 7)])
def test_experts_match_reference(layout, dtype, n, n_experts):
    gen = torch.Generator().manual_seed(10 * n + n_experts)
    weights, ids = _routing(n, n_experts, gen)
    x = torch.randn(n, D, generator=gen).to(dtype)
    _assert_matches(x, weights, ids, _experts(n_experts, gen, layout))


@LAYOUTS
def test_every_pair_on_one_expert(layout):
    """20 tokens x 3 picks of expert 2 of 3: 60 pairs in one slot, in blocks of 16; the other slots empty."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(20, D, generator=gen)
    weights = torch.rand(20, K, generator=gen)
    _assert_matches(x, weights, torch.full((20, K), 2), _experts(3, gen, layout), block_m=16)


@LAYOUTS
def test_prefill_tiles_over_several_pair_blocks(layout):
    """LARGE_TILES (pair blocks of 128; the weight tiles clamped to these widths): 100 tokens x 3 picks on 2 experts,
    150 and 150 pairs, each in two blocks."""
    gen = torch.Generator().manual_seed(23)
    x = torch.randn(100, D, generator=gen)
    weights = torch.rand(100, K, generator=gen)
    _assert_matches(x, weights, torch.arange(K).repeat(100, 1) % 2, _experts(2, gen, layout), **LARGE_TILES)


def test_prefill_tiles_beyond_64_pairs_an_expert_where_shared_memory_allows():
    cuda = types.SimpleNamespace(type="cuda")
    with mock.patch("engine.kernels.fp4_moe.shared_memory_limit", return_value=227 * 1024):
        assert expert_tiles(8192, 8192 * 6, 256, cuda) is LARGE_TILES
        assert expert_tiles(2048, 2048 * 6, 256, cuda)["block_m"] == 64  # 48 pairs an expert
        assert expert_tiles(16, 16 * 6, 256, cuda)["block_m"] == 16
    with mock.patch("engine.kernels.fp4_moe.shared_memory_limit", return_value=99 * 1024):
        assert expert_tiles(8192, 8192 * 6, 256, cuda)["block_m"] == 64
    assert expert_tiles(8192, 8192 * 6, 256, torch.device("cpu"))["block_m"] == 64


def test_mxfp4_zero_blocks_extreme_scales_and_uint8_codes():
    """Scales from 2**-127 (byte 0) to 2**53 beside ordinary ones, blocks of zero codes, uint8 codes as int8's."""
    gen = torch.Generator().manual_seed(22)
    w1, w3, w2 = _experts(5, gen)
    raw1 = w1.scale.view(torch.uint8)
    raw1[0, :4, 0], raw1[1, :4, 1], raw1[2, 3, :] = 0, 127 + 53, 127 - 90
    w1.codes[3, :8, :16] = 0
    w2.scale.view(torch.uint8)[1, :8, 0] = 127 - 60
    weights, ids = _routing(6, 5, gen)
    x = torch.randn(6, D, generator=gen)
    _assert_matches(x, weights, ids, (PackedFp4(w1.codes.view(torch.uint8), w1.scale), w3, w2))


def test_nvfp4_zero_subnormal_and_largest_scales_and_int8_codes():
    """e4m3 block scales of 0, the smallest subnormal (2**-9) and 448 beside ordinary ones, global scales from 2**-20
    to 2**4, blocks of zero codes, int8 codes as uint8's."""
    gen = torch.Generator().manual_seed(24)
    w1, w3, w2 = _experts(5, gen, "nvfp4")
    raw1 = w1.scale.view(torch.uint8)
    raw1[0, :4, 0], raw1[1, :4, 1], raw1[2, 3, :] = 0, 0x01, 0x7E  # 0x7E: e4m3's largest finite value, 448
    w1.global_scale[3], w2.global_scale[1] = 2.0**-20, 2.0**4
    w1.codes[4, :8, :16] = 0
    weights, ids = _routing(6, 5, gen)
    x = torch.randn(6, D, generator=gen)
    _assert_matches(x, weights, ids, (PackedFp4(w1.codes.view(torch.int8), w1.scale, w1.global_scale), w3, w2))


@LAYOUTS
@pytest.mark.parametrize(("n", "block_m"), [(1, None), (20, 16)], ids=["one-token", "looped-pair-blocks"])
def test_split_k_matches_unsplit_and_resets_its_counters(layout, n, block_m):
    """K split in 2 for gate/up and down, or not: the same result to fp32 rounding (only the sums' order differs),
    and every tile counter back at zero, so the next launch (or graph replay) starts clean. 20 tokens on 2 experts:
    pairs in several blocks of 16 per expert, each block's partials added by the tile's last program."""
    gen = torch.Generator().manual_seed(50 + n)
    on_two = (torch.rand(n, K, generator=gen), torch.arange(K).repeat(n, 1) % 2)
    weights, ids = _routing(n, 4, gen) if n == 1 else on_two
    x = torch.randn(n, D, generator=gen)
    experts = _experts(4, gen, layout)
    ref = moe_expert_pairs_fp4_reference(x, weights, ids, *experts, LIMIT)
    runs = {splits: moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT, block_k=32, block_m=block_m,
                                                splits_up=splits, splits_down=splits) for splits in (1, 2)}  # fmt: skip
    for got in runs.values():
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert not tile_counters(x.device, 1).any()


@LAYOUTS
def test_reference_against_dequantize_then_matmul(layout):
    """The reference is the bf16 experts' reference over the dequantized weights: in float64, to 1e-6 of fp32."""
    gen = torch.Generator().manual_seed(23)
    experts = _experts(4, gen, layout)
    weights, ids = _routing(5, 4, gen)
    x = torch.randn(5, D, generator=gen)
    ref = moe_expert_pairs_fp4_reference(x, weights, ids, *experts, LIMIT).double()
    dense = [w.dequantized(torch.arange(4), torch.float64) for w in experts]
    exact = moe_expert_pairs_reference(x.double(), weights.double(), ids, *dense, LIMIT)
    assert (ref - exact).norm() <= 1e-6 * exact.norm()


@LAYOUTS
def test_picks_of_another_ranks_experts_are_zero_rows_and_not_counted(layout):
    """Ids of 3 (this rank holds 3 experts) are another rank's picks: zero rows, not counted, the rest exact."""
    gen = torch.Generator().manual_seed(40)
    weights, ids = _routing(9, 6, gen)
    local = torch.where(ids < 3, ids, 3)
    x = torch.randn(9, D, generator=gen)
    experts = _experts(3, gen, layout)
    touched, ref_touched = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    got = moe_expert_pairs_fp4_triton(x, weights, local, *experts, LIMIT, touched, remote=True, block_k=32)
    ref = moe_expert_pairs_fp4_reference(x, weights, local, *experts, LIMIT, ref_touched, remote=True)
    remote = (local == 3).reshape(-1)
    assert remote.any() and (got[remote] == 0).all() and (ref[remote] == 0).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert touched.item() == ref_touched.item() == len(torch.unique(local[local < 3]))


def test_mixed_layouts_are_refused():
    gen = torch.Generator().manual_seed(41)
    mx, nv = _experts(2, gen), _experts(2, gen, "nvfp4")
    weights, ids = _routing(2, 2, gen)
    with pytest.raises(ValueError, match="laid out alike"):
        moe_expert_pairs_fp4_triton(torch.randn(2, D), weights, ids, nv[0], nv[1], mx[2], LIMIT)
