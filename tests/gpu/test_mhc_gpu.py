"""The mHC, RMSNorm and RoPE Triton kernels against their references on a real GPU at V4-Flash sizes (hidden 4096,
hc 4, 20 Sinkhorn iterations, 64 heads x 512 with RoPE on the last 64, q LoRA 1024) at decode batch sizes, and
inside a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import mhc, norm, rope
from engine.model.layers import rope_inv_freq
from tests.gpu.graphs import capture

pytestmark = pytest.mark.gpu
DEV = "cuda"
HC, DIM, HEADS, HEAD_DIM, Q_LORA, ITERS, HC_EPS, NORM_EPS = 4, 4096, 64, 512, 1024, 20, 1e-6, 1e-6
DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 16, 64]


def _close(got: torch.Tensor, want: torch.Tensor, rounded_inputs: bool = False) -> None:
    """fp32: summation order over K = 16384 and the GPU's exp / rsqrt (TF32 would be ~3e-4); bf16: one rounding
    step of the output, or, where the kernel rounds an intermediate to bf16 as the reference does (the q norm's
    1/rms), a last-bit difference there scaling a whole row: bounded, and rare (checked in the mean)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-5)
    elif rounded_inputs:
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=6e-2)
        assert (got.float() - want.float()).abs().mean() < 2e-3
    else:
        torch.testing.assert_close(got, want)


def _hc_params(mix: int, n_scales: int, gen: torch.Generator):
    k = HC * DIM
    fn = torch.randn(mix, k, device=DEV, generator=gen) * k**-0.5
    base = torch.randn(mix, device=DEV, generator=gen) * 0.5
    return fn, base, torch.rand(n_scales, device=DEV, generator=gen) + 0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [*TOKENS, 2048])  # 2048: a prefill chunk, where the GEMV runs with fewer K splits
def test_hc_pre_at_flash_sizes(dtype, n):
    gen = torch.Generator(device=DEV).manual_seed(0)
    streams = torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype)
    params = (*_hc_params((2 + HC) * HC, 3, gen), HC_EPS, NORM_EPS, ITERS)
    for got, want in zip(mhc.hc_pre_triton(streams, *params), mhc.hc_pre_reference(streams, *params), strict=True):
        _close(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_hc_post_and_head_at_flash_sizes(dtype, n):
    gen = torch.Generator(device=DEV).manual_seed(1)
    streams = torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype)
    out = torch.randn(n, DIM, device=DEV, generator=gen).to(dtype)
    post = 2 * torch.rand(n, HC, device=DEV, generator=gen)
    comb = torch.rand(n, HC, HC, device=DEV, generator=gen)
    _close(mhc.hc_post_triton(out, streams, post, comb), mhc.hc_post_reference(out, streams, post, comb))
    params = (*_hc_params(HC, 1, gen), HC_EPS, NORM_EPS)
    _close(mhc.hc_head_triton(streams, *params), mhc.hc_head_reference(streams, *params))


def test_sinkhorn_training_kernel_forward_and_backward_at_a_training_steps_tokens():
    """The demo model's training (FLASHGATE_KERNELS=autograd) takes Sinkhorn through sinkhorn_triton: comb and the
    logits' gradient as autograd takes them through the reference, over a row of 8,192 tokens."""
    gen = torch.Generator(DEV).manual_seed(3)
    logits = (torch.randn(8192, HC, HC, device=DEV, generator=gen) * 2).requires_grad_()
    upstream = torch.randn(8192, HC, HC, device=DEV, generator=gen)
    want = mhc.sinkhorn_reference(logits, HC_EPS, ITERS)
    (want_grad,) = torch.autograd.grad((want * upstream).sum(), logits)
    got = mhc.sinkhorn_triton(logits, HC_EPS, ITERS)
    (got_grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    _close(got, want.detach())
    _close(got_grad, want_grad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [*TOKENS, 48, 2048])  # 48: a captured size not a power of two; 2048: a prefill chunk
def test_hc_post_mix_at_flash_sizes_eager_and_in_a_cuda_graph(dtype, n):
    """hc_post fused with the next hc_pre's mixes, then that hc_pre (and likewise hc_head): what the separate
    references give, and a captured graph's replay on new inputs gives what eager launches give."""
    gen = torch.Generator(device=DEV).manual_seed(5)
    streams = torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype)
    out = (torch.randn(n, DIM, device=DEV, generator=gen) * 3).to(dtype)
    post = 2 * torch.rand(n, HC, device=DEV, generator=gen)
    comb = torch.rand(n, HC, HC, device=DEV, generator=gen)
    pre_params = (*_hc_params((2 + HC) * HC, 3, gen), HC_EPS, NORM_EPS, ITERS)
    head_params = (*_hc_params(HC, 1, gen), HC_EPS, NORM_EPS)

    def fused():
        new, mix = mhc.hc_post_mix_triton(out, streams, post, comb, pre_params[0])
        x, post2, comb2 = mhc.hc_pre_triton(new, *pre_params, mix=mix)
        new2, mix = mhc.hc_post_mix_triton(x, new, post2, comb2, head_params[0])
        return new, x, post2, comb2, new2, mhc.hc_head_triton(new2, *head_params, mix=mix)

    got = fused()
    # Each reference step starts from the kernels' previous outputs: a last-bit difference in a stream would
    # otherwise move a cancelling weighted sum by more than its own rounding.
    want = (mhc.hc_post_reference(out, streams, post, comb), *mhc.hc_pre_reference(got[0], *pre_params))
    want += (mhc.hc_post_reference(got[1], got[0], got[2], got[3]), mhc.hc_head_reference(got[4], *head_params))
    for g, w in zip(got, want, strict=True):
        _close(g, w)
    graph, captured = capture(fused)
    streams.copy_(torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype))
    out.copy_((torch.randn(n, DIM, device=DEV, generator=gen) * 3).to(dtype))
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(captured, fused(), strict=True):  # deterministic: splits summed in a fixed order, no atomics
        assert torch.equal(g, w)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_rms_norm_at_flash_sizes(dtype, n):
    gen = torch.Generator(device=DEV).manual_seed(2)
    for shape in [(n, DIM), (n, Q_LORA), (n, HEAD_DIM), (n, HC, DIM)]:  # attn/ffn, q, kv norms; MTP's hnorm
        x = (torch.randn(shape, device=DEV, generator=gen) * 5).to(dtype)
        weight = torch.rand(shape[-1], device=DEV, generator=gen) + 0.5
        _close(norm.rms_norm_triton(x, weight, NORM_EPS), norm.rms_norm_reference(x, weight, NORM_EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", TOKENS)
def test_rope_kernels_at_flash_sizes(dtype, n):
    gen = torch.Generator(device=DEV).manual_seed(3)
    positions = torch.randint(0, 1 << 20, (n,), device=DEV, generator=gen)  # up to the 1M context
    inv_freq = rope_inv_freq(64, 160000.0, None).to(DEV)
    q = (torch.randn(n, HEADS, HEAD_DIM, device=DEV, generator=gen) * 3).to(dtype)
    got = rope.rms_rope_triton(q, positions, inv_freq, NORM_EPS)
    _close(got, rope.rms_rope_reference(q, positions, inv_freq, NORM_EPS), rounded_inputs=True)
    attn_out = torch.randn(n, HEADS, HEAD_DIM, device=DEV, generator=gen)
    got = rope.rope_triton(attn_out, positions, inv_freq, inverse=True, dtype=dtype)
    _close(got, rope.rope_reference(attn_out, positions, inv_freq, inverse=True, dtype=dtype))
    for x in (q[:, 0], q[:, :, :128]):  # the kv row; index queries (64 x 128)
        x = x.contiguous()
        _close(rope.rope_triton(x, positions, inv_freq), rope.rope_reference(x, positions, inv_freq))


def test_kernels_capture_into_a_cuda_graph_and_replay():
    """A hyper-connected sublayer's kernels, captured once: a replay on new inputs gives what eager launches give."""
    n, dtype = 16, torch.bfloat16
    gen = torch.Generator(device=DEV).manual_seed(4)
    hc_params = (*_hc_params((2 + HC) * HC, 3, gen), HC_EPS, NORM_EPS, ITERS)
    head_params = (*_hc_params(HC, 1, gen), HC_EPS, NORM_EPS)
    norm_weight = torch.rand(DIM, device=DEV, generator=gen) + 0.5
    inv_freq = rope_inv_freq(64, 160000.0, None).to(DEV)
    streams = torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype)
    positions = torch.randint(0, 1 << 16, (n,), device=DEV, generator=gen)

    def sublayer():
        x, post, comb = mhc.hc_pre_triton(streams, *hc_params)
        h = norm.rms_norm_triton(x, norm_weight, NORM_EPS)
        q = rope.rms_rope_triton(h.view(n, DIM // HEAD_DIM, HEAD_DIM), positions, inv_freq, NORM_EPS)
        out = rope.rope_triton(q.float(), positions, inv_freq, inverse=True, dtype=dtype).view(n, DIM)
        new_streams = mhc.hc_post_triton(out, streams, post, comb)
        return q, new_streams, mhc.hc_head_triton(new_streams, *head_params)

    graph, captured = capture(sublayer)
    streams.copy_(torch.randn(n, HC, DIM, device=DEV, generator=gen).to(dtype))
    positions.copy_(torch.randint(0, 1 << 16, (n,), device=DEV, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, sublayer(), strict=True):  # every kernel is deterministic: no atomics
        assert torch.equal(got, want)
