"""The mHC, RMSNorm and RoPE Triton kernels against their plain-torch references, run by Triton's interpreter on
the CPU at small sizes (fp32 and bf16, one token and a batch that leaves a partial block), and inside the tiny model.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import dispatch, mhc, norm, rope
from engine.model.layers import rope_inv_freq
from tests.engine.conftest import prefill_logits

# tests/conftest.py selects Triton's interpreter on CPU machines; on a GPU tests/gpu/test_mhc_gpu.py runs these.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

DTYPES = [torch.float32, torch.bfloat16]
TOKENS = [1, 70]
HC, DIM, ITERS, HC_EPS, NORM_EPS = 4, 128, 20, 1e-6, 1e-6


def _close(got: torch.Tensor, want: torch.Tensor, rounded_inputs: bool = False) -> None:
    """fp32: a few ulps (summation order); bf16: one rounding step of the output. The interpreter truncates fp32 to
    bf16 where the GPU rounds to nearest, so where a kernel rounds an intermediate to bf16 (the q norm's 1/rms, the
    cast before rotating back), an output can move by an ulp of its inputs: checked in the mean there."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    elif rounded_inputs:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=6e-2)
        assert (got.float() - want.float()).abs().mean() < 1e-2
    else:
        torch.testing.assert_close(got, want)


def _hc_params(mix: int, n_scales: int, gen: torch.Generator):
    """Mixing weights that give O(1) mixes on rms-normalised streams, as trained ones do."""
    k = HC * DIM
    fn = torch.randn(mix, k, generator=gen) * k**-0.5
    return fn, torch.randn(mix, generator=gen) * 0.5, torch.rand(n_scales, generator=gen) + 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_hc_pre(dtype, n):
    gen = torch.Generator().manual_seed(0)
    streams = (torch.randn(n, HC, DIM, generator=gen) * 3).to(dtype)
    params = (*_hc_params((2 + HC) * HC, 3, gen), HC_EPS, NORM_EPS, ITERS)
    x, post, comb = mhc.hc_pre_triton(streams, *params)
    x_ref, post_ref, comb_ref = mhc.hc_pre_reference(streams, *params)
    _close(x, x_ref)
    _close(post, post_ref)
    _close(comb, comb_ref)
    assert torch.allclose(comb.sum(dim=1), torch.ones(n, HC), atol=1e-3)  # Sinkhorn: columns sum to 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_hc_post(dtype, n):
    gen = torch.Generator().manual_seed(1)
    streams = torch.randn(n, HC, DIM, generator=gen).to(dtype)
    out = torch.randn(n, DIM, generator=gen).to(dtype)
    post = 2 * torch.rand(n, HC, generator=gen)
    comb = torch.rand(n, HC, HC, generator=gen)
    _close(mhc.hc_post_triton(out, streams, post, comb), mhc.hc_post_reference(out, streams, post, comb))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 3, 64, 70])  # one token, a few (no tl.dot), a full dot block, a partial one
def test_hc_post_mix_feeds_the_next_hc_pre_and_hc_head(dtype, n):
    """hc_post fused with the next hc_pre's (or hc_head's) mixes: the same new streams, split mixes that sum to the
    reference's, and hc_pre / hc_head from them give what they give making their own mixes."""
    gen = torch.Generator().manual_seed(6)
    streams = torch.randn(n, HC, DIM, generator=gen).to(dtype)
    out = (torch.randn(n, DIM, generator=gen) * 3).to(dtype)
    post = 2 * torch.rand(n, HC, generator=gen)
    comb = torch.rand(n, HC, HC, generator=gen)
    pre_params = (*_hc_params((2 + HC) * HC, 3, gen), HC_EPS, NORM_EPS, ITERS)
    head_params = (*_hc_params(HC, 1, gen), HC_EPS, NORM_EPS)
    mixes = {}
    for fn in (pre_params[0], head_params[0]):
        new, mix = mhc.hc_post_mix_triton(out, streams, post, comb, fn)
        new_ref, mix_ref = mhc.hc_post_mix_reference(out, streams, post, comb, fn)
        _close(new, new_ref)
        # The mixes are those of the streams stored (the interpreter rounds bf16 its own way: compare with those).
        want = mhc.hc_mix_reference(new, fn)
        assert mix.dots.shape[:2] == (n, fn.shape[0]) and mix.sq.shape == (n, mix.dots.shape[2])
        torch.testing.assert_close(mix.sq.sum(-1), want.sq[:, 0], rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(mix.dots.sum(-1), want.dots[:, :, 0], rtol=1e-5, atol=1e-4)
        mixes[fn.shape[0]] = mix, mix_ref
    want = mhc.hc_pre_reference(new, *pre_params)
    for got, ref in zip(mhc.hc_pre_triton(new, *pre_params, mix=mixes[(2 + HC) * HC][0]), want, strict=True):
        _close(got, ref)
    want = mhc.hc_pre_reference(new_ref, *pre_params)
    for got, ref in zip(mhc.hc_pre_reference(new_ref, *pre_params, mix=mixes[(2 + HC) * HC][1]), want, strict=True):
        _close(got, ref)
    _close(mhc.hc_head_triton(new, *head_params, mix=mixes[HC][0]), mhc.hc_head_reference(new, *head_params))
    want = mhc.hc_head_reference(new_ref, *head_params)
    _close(mhc.hc_head_reference(new_ref, *head_params, mix=mixes[HC][1]), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_hc_head(dtype, n):
    gen = torch.Generator().manual_seed(2)
    streams = torch.randn(n, HC, DIM, generator=gen).to(dtype)
    params = (*_hc_params(HC, 1, gen), HC_EPS, NORM_EPS)
    _close(mhc.hc_head_triton(streams, *params), mhc.hc_head_reference(streams, *params))


@pytest.mark.parametrize("n", TOKENS)
def test_sinkhorn_forward_and_backward_match_the_references_autograd(n):
    """The training kernel: comb and the logits' gradient (through every normalisation and the softmax, rebuilt from
    the kept divisors) as autograd takes them through sinkhorn_reference."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(n, HC, HC, generator=gen) * 2).requires_grad_()
    upstream = torch.randn(n, HC, HC, generator=gen)
    (want,) = torch.autograd.grad((mhc.sinkhorn_reference(logits, HC_EPS, ITERS) * upstream).sum(), logits)
    comb = mhc.sinkhorn_triton(logits, HC_EPS, ITERS)
    (got,) = torch.autograd.grad((comb * upstream).sum(), logits)
    _close(comb, mhc.sinkhorn_reference(logits, HC_EPS, ITERS).detach())
    _close(got, want)
    assert got.abs().max() > 0.1  # a gradient that matters, not two zeros


def test_the_autograd_kernels_run_only_where_asked_and_on_cuda(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.setenv("FLASHGATE_KERNELS", "autograd")
    assert dispatch.use_autograd_triton(cuda) and not dispatch.use_autograd_triton(cpu)
    assert not dispatch.use_triton(cuda)  # every other operation: its reference
    for choice in ("auto", "torch", "triton"):
        monkeypatch.setenv("FLASHGATE_KERNELS", choice)
        assert not dispatch.use_autograd_triton(cuda)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 256), (70, 96), (5, HC, 64)])  # one row, a width not a power of two, 3-d
def test_rms_norm(dtype, shape):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(shape, generator=gen) * 5).to(dtype)
    weight = torch.rand(shape[-1], generator=gen) + 0.5
    _close(norm.rms_norm_triton(x, weight, NORM_EPS), norm.rms_norm_reference(x, weight, NORM_EPS))


def _rope_inputs(n: int, heads: int, dim: int, gen: torch.Generator):
    # Positions up to 10^5 (YaRN frequencies): the angles are large, as at long context.
    positions = torch.randint(0, 100_000, (n,), generator=gen)
    return torch.randn(n, heads, dim, generator=gen), positions, rope_inv_freq(64, 160000.0, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "dim"), [(1, 128), (70, 64)])  # rope on the last 64 channels, or on all of them
def test_rms_rope(dtype, n, dim):
    x, positions, inv_freq = _rope_inputs(n, 8, dim, torch.Generator().manual_seed(4))
    x = (x * 3).to(dtype)
    got = rope.rms_rope_triton(x, positions, inv_freq, NORM_EPS)
    _close(got, rope.rms_rope_reference(x, positions, inv_freq, NORM_EPS), rounded_inputs=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_with_cast(dtype, inverse):
    """The kv rotation (same dtype) and the output's rotation back, cast from the fp32 attention output."""
    x, positions, inv_freq = _rope_inputs(70, 8, 128, torch.Generator().manual_seed(5))
    x = x if inverse else x.to(dtype)
    got = rope.rope_triton(x, positions, inv_freq, inverse, dtype)
    _close(got, rope.rope_reference(x, positions, inv_freq, inverse, dtype), rounded_inputs=inverse)
    if inverse:  # rotating back undoes the rotation
        back = rope.rope_reference(rope.rope_reference(x, positions, inv_freq), positions, inv_freq, inverse=True)
        torch.testing.assert_close(back, x, rtol=1e-5, atol=1e-5)


def test_tiny_model_through_these_kernels_gives_the_reference_logits(fp32_model, prompt_ids, monkeypatch):
    """hc_pre / hc_post / hc_head, RMSNorm, q norm + RoPE and the RoPE kernels inside the model, the other kernels on
    their references: a prefill across a c128 boundary gives the plain-torch logits. (Decode through every kernel is
    test_model_parity's slow test, under FLASHGATE_KERNELS=triton.)"""
    ids = prompt_ids[:132]
    reference = prefill_logits(fp32_model, ids)
    for module in (mhc, norm, rope):
        monkeypatch.setattr(module, "use_triton", lambda device: True)
    assert (prefill_logits(fp32_model, ids) - reference).abs().max().item() <= 1e-4
