"""The MoE block's launch-cutting kernels against their references, in Triton's interpreter at small sizes: the gate
from x (partial logits over splits of D, then the selection; hash layers with only the picked experts' logits), the
counting sort of (token, pick) pairs by expert (and its count of the experts touched), the shared expert's SwiGLU, the
combine of picks and shared expert, the routed pairs, and the shared expert's fused gate/up weight.
tests/gpu/test_moe_gpu.py runs them at size."""

from __future__ import annotations

import types

import pytest
import torch

import engine.model.moe as moe_model
from engine.kernels.moe import (
    PREFILL_TOKENS,
    gate_route_reference,
    gate_route_triton,
    group_pairs_by_expert_reference,
    group_pairs_by_expert_triton,
    moe_combine_reference,
    moe_combine_triton,
    moe_expert_pairs_reference,
    moe_expert_pairs_triton,
    moe_experts_reference,
    shared_swiglu_reference,
    shared_swiglu_triton,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

E, K, VOCAB, LIMIT, SCALE = 8, 3, 50, 1.0, 1.5


def clear_margin(logits: torch.Tensor, bias: torch.Tensor, top_k: int, margin: float = 1e-4) -> torch.Tensor:
    """Tokens whose selection no last-bit difference of the logits can change: the k-th and (k+1)-th keys (and
    every two picked keys, since the picks' order is compared too) are more than `margin` apart."""
    key = torch.sqrt(torch.nn.functional.softplus(logits)) + bias
    top = key.topk(top_k + 1, dim=-1).values
    return (top[:, :-1] - top[:, 1:]).min(dim=-1).values > margin


def _gate_inputs(n: int, dim: int, dtype: torch.dtype, seed: int, n_experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=gen).to(dtype)
    weight = (torch.randn(n_experts, dim, generator=gen) * 3 * dim**-0.5).to(dtype)
    bias = torch.randn(n_experts, generator=gen)
    table = torch.randint(0, n_experts, (VOCAB, K), generator=gen)
    table[7] = torch.tensor([5, 5, 2])  # a hash row naming an expert twice
    input_ids = torch.randint(0, VOCAB, (n,), generator=gen)
    input_ids[0] = 7
    return x, weight, bias, table, input_ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "dim"), [(1, 512), (9, 512), (70, 64)])  # D 512: 4 splits; 70 tokens: 2 blocks
def test_score_gate_matches_reference(dtype, n, dim):
    x, weight, bias, _, input_ids = _gate_inputs(n, dim, dtype, seed=n)
    ref_logits, got_logits = torch.empty(n, E), torch.full((n, E), float("nan"))
    ref_w, ref_ids = gate_route_reference(x, weight, bias, None, input_ids, K, SCALE, ref_logits)
    got_w, got_ids = gate_route_triton(x, weight, bias, None, input_ids, K, SCALE, got_logits)
    # fp32 products of the upcast operands, summed in another order than the reference's matmul.
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-5, atol=1e-5)
    clear = clear_margin(ref_logits, bias, K)
    assert clear.float().mean() > 0.9  # the inputs are not made of near-ties
    assert torch.equal(got_ids[clear], ref_ids[clear])
    torch.testing.assert_close(got_w[clear], ref_w[clear], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w.sum(-1), torch.full((n,), SCALE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 9])
def test_hash_gate_matches_reference(dtype, n):
    """The table's experts as they are (a duplicate is two picks with one weight each); weights from only the picked
    experts' logits."""
    x, weight, bias, table, input_ids = _gate_inputs(n, 640, dtype, seed=20 + n)  # 640: a partial last chunk
    ref_w, ref_ids = gate_route_reference(x, weight, bias, table, input_ids, K, SCALE)
    got_w, got_ids = gate_route_triton(x, weight, bias, table, input_ids, K, SCALE)
    assert torch.equal(got_ids, ref_ids) and got_ids[0].tolist() == [5, 5, 2]
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)


def test_gate_with_many_experts_and_no_tokens():
    """256 experts and top-6 as in V4-Flash (in 8 blocks of 32), and an empty batch."""
    x, weight, bias, _, input_ids = _gate_inputs(3, 128, torch.bfloat16, seed=3, n_experts=256)
    ref_logits, got_logits = torch.empty(3, 256), torch.empty(3, 256)
    ref_w, ref_ids = gate_route_reference(x, weight, bias, None, input_ids, 6, SCALE, ref_logits)
    got_w, got_ids = gate_route_triton(x, weight, bias, None, input_ids, 6, SCALE, got_logits)
    torch.testing.assert_close(got_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert clear_margin(ref_logits, bias, 6).all()
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w, rtol=1e-5, atol=1e-6)
    empty_w, empty_ids = gate_route_triton(x[:0], weight, bias, None, input_ids[:0], 6, SCALE)
    assert empty_w.shape == (0, 6) and empty_ids.shape == (0, 6)


@pytest.mark.parametrize(
    ("pairs", "n_experts", "case"),
    [(6, 256, "random"), (96, 256, "random"), (384, 256, "random"), (384, 256, "one"), (60, 8, "one"),
     (1, 8, "random"), (30, 12, "random"), (1100, 16, "random"), (90, 256, "hash-duplicates")],
)  # fmt: skip
def test_group_pairs_matches_reference(pairs, n_experts, case):
    """Same order (stable within an expert), offsets and active slots: random picks, every pair on one expert, an
    expert count that is no power of two, more pairs than one block (1100 > 512), and rows repeating an expert."""
    gen = torch.Generator().manual_seed(pairs)
    flat = torch.randint(0, n_experts, (pairs,), generator=gen)
    if case == "one":
        flat.fill_(n_experts - 2)
    if case == "hash-duplicates":
        flat.view(-1, 6)[:, 1] = flat.view(-1, 6)[:, 0]
    ref_got = zip(
        group_pairs_by_expert_reference(flat, n_experts), group_pairs_by_expert_triton(flat, n_experts), strict=True
    )
    for ref, got in ref_got:
        assert got.dtype == ref.dtype and torch.equal(got, ref)


@pytest.mark.parametrize("impl", [group_pairs_by_expert_reference, group_pairs_by_expert_triton], ids=["ref", "triton"])
def test_counting_sort_counts_the_experts_touched(impl):
    """Pairs on experts 3, 3, 1, 7, 1, 0 touch four experts, the first two pairs one: each call adds its count to
    the counter it is given (an element of a table at any offset, as the serving runner's are), none without."""
    flat = torch.tensor([3, 3, 1, 7, 1, 0])
    table = torch.zeros(2, 3, dtype=torch.int64)
    impl(flat, 8, table[1, 2])
    impl(flat[:2], 8, table[1, 2])
    impl(flat, 8, table[0, 1])
    impl(flat, 8)
    assert table.tolist() == [[0, 4, 0], [0, 0, 5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("limit", [0.0, 1.0])
def test_shared_swiglu_matches_reference(dtype, limit):
    """gate and up as the two halves of one [N, 2I] projection (strided rows), I not a multiple of the block."""
    gate_up = (torch.randn(5, 2 * 1200, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    gate, up = gate_up[:, :1200], gate_up[:, 1200:]
    ref, got = shared_swiglu_reference(gate, up, limit), shared_swiglu_triton(gate, up, limit)
    assert got.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # the interpreter truncates to bf16 where torch rounds
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("top_k", [1, 6])
def test_combine_matches_reference(dtype, top_k):
    gen = torch.Generator().manual_seed(top_k)
    pairs, shared = torch.randn(4 * top_k, 1100, generator=gen).to(dtype), torch.randn(4, 1100, generator=gen).to(dtype)
    ref, got = moe_combine_reference(pairs, shared, top_k), moe_combine_triton(pairs, shared, top_k)
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    else:  # one bf16 step (the interpreter truncates)
        torch.testing.assert_close(got.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "score"])
def test_expert_pairs_match_reference(hashed):
    """One row a (token, pick) pair, in x's dtype; summed per token they are moe_experts_reference."""
    d, inter = 64, 32
    x, weight, bias, table, input_ids = _gate_inputs(7, d, torch.float32, seed=4)
    weights, ids = gate_route_reference(x, weight, bias, table if hashed else None, input_ids, K, SCALE)
    gen = torch.Generator().manual_seed(5)
    w1, w3 = torch.randn(2, E, inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(E, d, inter, generator=gen) * inter**-0.5
    ref = moe_expert_pairs_reference(x, weights, ids, w1, w3, w2, LIMIT)
    got = moe_expert_pairs_triton(x, weights, ids, w1, w3, w2, LIMIT)
    assert got.shape == (7 * K, d) and got.dtype == x.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    summed = ref.view(7, K, d).sum(1)
    torch.testing.assert_close(summed, moe_experts_reference(x, weights, ids, w1, w3, w2, LIMIT), rtol=1e-5, atol=1e-6)


def test_expert_pairs_take_narrower_tiles_for_a_width_that_is_no_power_of_two():
    """The demo model's D=320 under a prefill chunk's launch (256-wide tiles): 64-wide tiles, the reference's sums."""
    d, inter, n = 320, 64, PREFILL_TOKENS + 1
    x, weight, bias, table, input_ids = _gate_inputs(n, d, torch.float32, seed=6)
    weights, ids = gate_route_reference(x, weight, bias, None, input_ids, K, SCALE)
    gen = torch.Generator().manual_seed(7)
    w1, w3 = torch.randn(2, E, inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(E, d, inter, generator=gen) * inter**-0.5
    got = moe_expert_pairs_triton(x, weights, ids, w1, w3, w2, LIMIT)
    torch.testing.assert_close(
        got, moe_expert_pairs_reference(x, weights, ids, w1, w3, w2, LIMIT), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("impl", [moe_expert_pairs_reference, moe_expert_pairs_triton], ids=["ref", "triton"])
def test_expert_pairs_count_the_distinct_experts_they_read(impl):
    """Picks [[5, 5, 2], [2, 0, 1]] (a hash row naming expert 5 twice) read four experts; no tokens read none."""
    d, inter = 64, 32
    gen = torch.Generator().manual_seed(12)
    x, weights = torch.randn(2, d, generator=gen), torch.rand(2, K, generator=gen)
    w1, w3 = torch.randn(2, E, inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(E, d, inter, generator=gen) * inter**-0.5
    touched = torch.zeros((), dtype=torch.int64)
    impl(x, weights, torch.tensor([[5, 5, 2], [2, 0, 1]]), w1, w3, w2, LIMIT, touched)
    assert touched.item() == 4
    impl(x[:0], weights[:0], torch.zeros(0, K, dtype=torch.long), w1, w3, w2, LIMIT, touched)
    assert touched.item() == 4


def _moe(hashed: bool, dtype: torch.dtype) -> moe_model.MoE:
    args = types.SimpleNamespace(
        hidden_size=64, moe_intermediate_size=32, n_routed_experts=E, num_experts_per_tok=K,
        routed_scaling_factor=SCALE, vocab_size=VOCAB, num_hash_layers=1 if hashed else 0, swiglu_limit=LIMIT,
        block_name=lambda i: f"layers.{i}",
    )  # fmt: skip
    module = moe_model.MoE(args, layer_id=0)
    gen = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
        if hashed:
            module.gate.tid2eid.copy_(torch.randint(0, E, (VOCAB, K), generator=gen))
    for name, param in module.named_parameters():
        if not name.endswith("gate.bias"):
            param.data = param.data.to(dtype)
    return module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "score"])
def test_moe_block_through_the_kernels(monkeypatch, hashed, dtype):
    """The whole block with FLASHGATE_KERNELS=triton (shared gate/up fused) against the references."""
    module = _moe(hashed, dtype)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(8)).to(dtype)
    input_ids = torch.randint(0, VOCAB, (6,), generator=torch.Generator().manual_seed(9))
    touched = torch.zeros(2, dtype=torch.int64)  # what each path counts as the experts the block read
    monkeypatch.setenv("FLASHGATE_KERNELS", "torch")
    module.touched = touched[0]
    with torch.no_grad():
        ref = module(x, input_ids)
        picked = module.gate(x, input_ids)[1].unique().numel()
    monkeypatch.setenv("FLASHGATE_KERNELS", "triton")
    module.touched = touched[1]
    with torch.no_grad():
        got = module(x, input_ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    assert touched.tolist() == [picked, picked]
