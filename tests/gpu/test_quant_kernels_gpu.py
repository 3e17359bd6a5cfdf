"""The FP8 block-scaled linears and the MXFP4 routed experts against their references on a real GPU at V4-Flash
shapes (reference §10): the dense projections at decode (M = 1, 64) and prefill (M = 300) sizes, wo_a grouped 8 ways,
ue8m0 and fp32 scales, the activation codes bit for bit; the 256 experts (2048 x 4096 gate/up, 4096 x 2048 down,
top-6); and both captured in CUDA graphs, replayed with new inputs."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.fp4_moe import PackedFp4, moe_expert_pairs_fp4_reference, moe_expert_pairs_fp4_triton
from engine.kernels.fp8_gemm import (
    fp8_block_grouped_linear_reference,
    fp8_block_grouped_linear_triton,
    fp8_block_linear_reference,
    fp8_block_linear_triton,
    quantize_activations_reference,
    quantize_activations_triton,
)
from engine.kernels.split_k import tile_counters
from tests.gpu.graphs import capture

pytestmark = pytest.mark.gpu
DEV = "cuda"
# name: (N, K) of the weight as stored; wo_a is 8 groups of 1024 rows
SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
          "shared_w13": (4096, 4096), "shared_w2": (4096, 2048)}  # fmt: skip
E, K, D, INTER, LIMIT = 256, 6, 4096, 2048, 10.0


def _fp8_weight(n: int, k: int, gen: torch.Generator, fp32_scale: bool = False):
    """Random e4m3 codes (no NaN) and scales near 2**-8, as a quantized weight of std ~0.02 has."""
    w = torch.randn(n, k, device=DEV, generator=gen).mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    raw = torch.randint(118, 123, (_blocks(n), _blocks(k)), device=DEV, generator=gen, dtype=torch.uint8)
    scale = raw.view(torch.float8_e8m0fnu)
    return w, scale.float() if fp32_scale else scale


def _blocks(n: int) -> int:
    return -(-n // 128)


def _close(got: torch.Tensor, ref: torch.Tensor) -> None:
    """The tensor cores' fp8 dot sums each 128-value block in their own order and precision (about 14 bits kept, as
    DeepSeek notes; hence the promotion per block): seen under 2e-4 relative."""
    assert not got.isnan().any()
    assert (got.float() - ref.float()).norm() <= 1e-3 * ref.float().norm()


@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("name", list(SHAPES))
def test_fp8_linear_at_flash_shapes(name, m):
    gen = torch.Generator(device=DEV).manual_seed(m)
    n, k = SHAPES[name]
    weight, scale = _fp8_weight(n, k, gen, fp32_scale=name == "shared_w2")
    x = torch.randn(m, k, device=DEV, generator=gen).bfloat16()
    codes, act_scale = quantize_activations_triton(x)
    ref_codes, ref_scale = quantize_activations_reference(x)
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8)) and torch.equal(act_scale, ref_scale)
    _close(fp8_block_linear_triton(x, weight, scale, torch.float32),
           fp8_block_linear_reference(x, weight, scale, torch.float32))  # fmt: skip


@pytest.mark.parametrize("m", [1, 64, 300])
def test_fp8_grouped_wo_a(m):
    gen = torch.Generator(device=DEV).manual_seed(m)
    weight, scale = _fp8_weight(8192, 4096, gen)
    x = torch.randn(m, 8, 4096, device=DEV, generator=gen).bfloat16()
    got = fp8_block_grouped_linear_triton(x, weight, scale)
    assert got.shape == (m, 8, 1024) and got.dtype == torch.bfloat16
    # compared in fp32: the bf16 output's own rounding is 1.7e-3 relative (seen on an H200 at da28c64)
    _close(fp8_block_grouped_linear_triton(x, weight, scale, torch.float32),
           fp8_block_grouped_linear_reference(x, weight, scale, torch.float32))  # fmt: skip


def test_fp8_linear_in_a_cuda_graph():
    """wq_b (no split) and wo_b (split K) at M = 16, and wo_a at 4: replays with new activations equal eager calls,
    and 50 replays of the same ones give the same bits."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    bf16 = dict(device=DEV, dtype=torch.bfloat16)
    layers = [(_fp8_weight(*SHAPES["wq_b"], gen), torch.empty(16, 1024, **bf16), False),
              (_fp8_weight(*SHAPES["wo_b"], gen), torch.empty(16, 8192, **bf16), False),
              (_fp8_weight(8192, 4096, gen), torch.empty(4, 8, 4096, **bf16), True)]  # fmt: skip

    def step():
        return [(fp8_block_grouped_linear_triton if grouped else fp8_block_linear_triton)(x, *w) for w, x, grouped in
                layers]  # fmt: skip

    for _, x, _ in layers:
        x.normal_(generator=gen)
    graph, outs = capture(step)
    for _ in range(2):
        for _, x, _ in layers:
            x.normal_(generator=gen)
        graph.replay()
        for got, want in zip(outs, step(), strict=True):
            assert torch.equal(got, want)
    first = [out.clone() for out in outs]
    for _ in range(50):  # the split launches' sums do not depend on which program arrives last
        graph.replay()
    assert all(torch.equal(out, want) for out, want in zip(outs, first, strict=True))
    assert not tile_counters(outs[0].device, 1).any()


@pytest.fixture(scope="module")
def experts():
    """Packed codes (random bytes) and ue8m0 scales near 2**-8: w1, w3 [E, I, D/2] + [E, I, D/32], w2 [E, D, I/2] +
    [E, D, I/32] (3.4 GB)."""
    gen = torch.Generator(device=DEV).manual_seed(0)

    def packed(rows, cols):
        codes = torch.randint(0, 256, (E, rows, cols // 2), device=DEV, generator=gen, dtype=torch.uint8)
        scale = torch.randint(117, 121, (E, rows, cols // 32), device=DEV, generator=gen, dtype=torch.uint8)
        return PackedFp4(codes, scale.view(torch.float8_e8m0fnu))

    return packed(INTER, D), packed(INTER, D), packed(D, INTER)


def _routing(n: int, gen: torch.Generator, n_experts: int = E):
    ids = torch.rand(n, n_experts, device=DEV, generator=gen).topk(K, dim=-1).indices
    weights = torch.rand(n, K, device=DEV, generator=gen)
    return weights / weights.sum(-1, keepdim=True) * 1.5, ids


@pytest.mark.parametrize(("n", "n_experts"), [(1, E), (16, E), (64, 32), (3072, 32)])
def test_mxfp4_experts_at_flash_sizes(experts, n, n_experts):
    """Batch 64 routes among 32 experts only: the reference dequantizes every expert it touches. 3072 tokens: a
    prefill chunk's LARGE_TILES (72 pairs an expert of 256 on average; here 576 of each of 32, in 5 blocks)."""
    gen = torch.Generator(device=DEV).manual_seed(100 + n)
    weights, ids = _routing(n, gen, n_experts)
    x = torch.randn(n, D, device=DEV, generator=gen).bfloat16()
    touched = torch.zeros(1, dtype=torch.int64, device=DEV)
    got = moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT, touched)
    ref = moe_expert_pairs_fp4_reference(x, weights, ids, *experts, LIMIT)
    assert touched.item() == len(torch.unique(ids))
    # The reference rounds gate/up to bf16 before SwiGLU, the kernel keeps them in fp32 (as the bf16 path's test).
    torch.testing.assert_close(got.float(), ref.float(), rtol=2e-2, atol=4e-2)
    assert (got.float() - ref.float()).norm() <= 1e-2 * ref.float().norm()


@pytest.mark.parametrize("n", [1, 16], ids=["split-k", "unsplit"])
def test_mxfp4_experts_in_a_cuda_graph(experts, n):
    """Replays with new routing equal eager calls bit for bit; at one token K is split (6 experts leave the GPU
    short of programs), and 50 replays of the same inputs give the same bits whichever program adds the splits."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(n, D, device=DEV, generator=gen).bfloat16()
    weights, ids = _routing(n, gen)
    graph, out = capture(lambda: moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT))
    for seed in (6, 7):
        new_weights, new_ids = _routing(n, torch.Generator(device=DEV).manual_seed(seed))
        x.normal_(generator=gen)
        weights.copy_(new_weights)
        ids.copy_(new_ids)
        graph.replay()
        assert torch.equal(out, moe_expert_pairs_fp4_triton(x, weights, ids, *experts, LIMIT))
    first = out.clone()
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)
    assert not tile_counters(x.device, 1).any()
