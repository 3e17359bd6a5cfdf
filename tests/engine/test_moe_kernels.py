"""The MoE kernels (routing, grouped-GEMM experts) against their references, run by Triton's interpreter on the CPU at
small sizes: hash and score routing, duplicate experts in a hash row, experts with no tokens, every token on one
expert, one token and several, fp32 and bf16 weights; and the tiny model through them. The router-from-x kernels,
the counting sort and the epilogue (shared SwiGLU, combine) are in test_moe_fused.py."""

from __future__ import annotations

import pytest
import torch

import engine.model.moe as moe_model
import engine.model.weight_formats as weight_formats
from engine.kernels.moe import (
    gate_route_triton,
    moe_combine_triton,
    moe_expert_pairs_reference,
    moe_expert_pairs_triton,
    moe_experts_reference,
    moe_experts_triton,
    route_reference,
    shared_swiglu_triton,
)
from tests.engine.conftest import prefill_logits

# tests/conftest.py selects Triton's interpreter on CPU machines; tests/gpu/test_moe_gpu.py runs the checks at size.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

E, K, D, INTER, VOCAB, LIMIT = 8, 3, 64, 32, 50, 1.0  # a limit of 1 makes the SwiGLU clamp bite


def _experts(dtype: torch.dtype, gen: torch.Generator, n_experts: int = E):
    w1 = torch.randn(n_experts, INTER, D, generator=gen) * D**-0.5
    w3 = torch.randn(n_experts, INTER, D, generator=gen) * D**-0.5
    w2 = torch.randn(n_experts, D, INTER, generator=gen) * INTER**-0.5
    return w1.to(dtype), w3.to(dtype), w2.to(dtype)


def _routing(n: int, hashed: bool, gen: torch.Generator):
    logits = torch.randn(n, E, generator=gen) * 3
    bias = torch.randn(E, generator=gen)
    table = torch.randint(0, E, (VOCAB, K), generator=gen)
    table[7] = torch.tensor([5, 5, 2])  # a hash row naming an expert twice
    input_ids = torch.randint(0, VOCAB, (n,), generator=gen)
    input_ids[0] = 7
    return logits, bias, table if hashed else None, input_ids


def _assert_experts_match(x, weights, ids, w1, w3, w2, **launch):
    ref = moe_experts_reference(x, weights, ids, w1, w3, w2, LIMIT)
    out = moe_experts_triton(x, weights, ids, w1, w3, w2, LIMIT, **launch)
    assert out.dtype == torch.float32 and out.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    else:  # the kernel's gate/up stay fp32 where the reference rounds them; the interpreter truncates to bf16
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hashed", [True, False], ids=["hash", "score"])
@pytest.mark.parametrize("n", [1, 9])
def test_experts_match_reference(dtype, hashed, n):
    gen = torch.Generator().manual_seed(10 + n)
    weights, ids = route_reference(*_routing(n, hashed, gen), K, 1.5)
    if hashed:
        assert ids[0].tolist() == [5, 5, 2]  # the duplicate pick is two pairs, each with its own weight
    x = torch.randn(n, D, generator=gen).to(dtype)
    _assert_experts_match(x, weights, ids, *_experts(dtype, gen))


def test_experts_with_no_tokens():
    """One token, two picks, 16 experts: two slots in the grid, fourteen experts never read."""
    gen = torch.Generator().manual_seed(20)
    x = torch.randn(1, D, generator=gen)
    weights = torch.tensor([[0.9, 0.6]])
    _assert_experts_match(x, weights, torch.tensor([[13, 2]]), *_experts(torch.float32, gen, n_experts=16))


@pytest.mark.parametrize("block_m", [16, 64])
def test_all_tokens_on_one_expert(block_m):
    """20 tokens x 3 picks, all expert 6 (hash rows may do this): 60 pairs in one slot, in blocks of block_m."""
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(20, D, generator=gen)
    weights = torch.rand(20, K, generator=gen)
    ids = torch.full((20, K), 6)
    _assert_experts_match(x, weights, ids, *_experts(torch.float32, gen), block_m=block_m)


def test_tiny_model_through_the_moe_kernels(fp32_model, prompt_ids, monkeypatch):
    """Every MoE layer of the tiny model (three hash-routed, the rest score-routed) through the Triton routing and
    grouped GEMM gives the plain-torch logits. Only the MoE is switched, to keep the interpreter's time small; with
    FLASHGATE_KERNELS=triton every kernel runs in test_model_parity.py's decode test (slow)."""
    ids = prompt_ids[:24]
    ref = prefill_logits(fp32_model, ids)
    monkeypatch.setattr(moe_model, "gate_route", gate_route_triton)
    monkeypatch.setattr(weight_formats, "moe_expert_pairs", moe_expert_pairs_triton)
    monkeypatch.setattr(moe_model, "shared_swiglu", shared_swiglu_triton)
    monkeypatch.setattr(moe_model, "moe_combine", moe_combine_triton)
    got = prefill_logits(fp32_model, ids)
    assert (got - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("n", [1, 9])
def test_picks_of_another_ranks_experts_are_zero_rows_and_not_counted(n):
    """A rank holding 4 of the 8 experts sees the others' picks as id 4: the kernels give them zero rows, compute
    this rank's picks as the whole layer would, and count only this rank's experts."""
    gen = torch.Generator().manual_seed(30 + n)
    weights, ids = route_reference(*_routing(n, False, gen), K, 1.5)
    x = torch.randn(n, D, generator=gen)
    w1, w3, w2 = _experts(torch.float32, gen)
    first, count = 4, 4
    local = torch.where((ids >= first) & (ids < first + count), ids - first, count)
    held = (w1[first:], w3[first:], w2[first:])
    touched, ref_touched = torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    got = moe_expert_pairs_triton(x, weights, local, *held, LIMIT, touched, remote=True)
    ref = moe_expert_pairs_reference(x, weights, local, *held, LIMIT, ref_touched, remote=True)
    whole = moe_expert_pairs_reference(x, weights, ids, w1, w3, w2, LIMIT)
    mine = (local < count).reshape(-1)
    assert (got[~mine] == 0).all() and (ref[~mine] == 0).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[mine], whole[mine], rtol=1e-5, atol=1e-5)
    assert touched.item() == ref_touched.item() == len(torch.unique(local[local < count]))
