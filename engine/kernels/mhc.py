"""mHC (reference §4): hc_pre mixes the `hc` residual streams into a sublayer's input and makes the sublayer's post
weights and the doubly-stochastic comb; hc_post writes the sublayer's output back into the streams; hc_head
collapses the streams once before the final norm.

Plain torch spends ~140 launches on one hc_pre (20 Sinkhorn iterations of sums and divisions on a 4x4 matrix), ~6
on hc_post and ~17 on hc_head. The Triton path splits hc_pre and hc_head into their mixes and their weights:
  `_hc_streams_kernel`: per block of tokens and split of D (~256 programs at decode batch sizes), for every stream j
      the split's columns j*D + d of the flattened streams: their partial sum of squares and their partial dot
      products with the mixing weights fn (a split-K GEMV, fp32-exact: `HcMix`). With WITH_POST it first makes
      those streams, H'_j = post_j * F + sum_i comb[i, j] * H_i, and stores them: hc_post of one sublayer and the
      mixes of the next hc_pre (or hc_head) in one launch and one read of the streams (`hc_post_mix`). The model
      passes the mixes along, so at every sublayer boundary of a decode step hc_pre is one launch.
  `_hc_mix_kernel`: the same mixes for a prefill chunk (more than FUSED_MIX_TOKENS tokens), a tl.dot over 16+ rows
      (three TF32 products: fp32's precision) and K splits to fill the GPU four times over, after a plain hc_post.
  `_hc_weights_kernel`: per token, sums the splits, scales by 1/rms, takes the sigmoids and, for hc_pre, the softmax
      and Sinkhorn iterations on the 4x4 comb, one value per entry in each thread's registers; then the
      pre-weighted sum of the streams over its block of D. Every block of D recomputes the weights, so the sum is
      spread over many programs. Splits are summed in a fixed order: the result does not depend on timing.
The Triton hc_pre needs hc = 4 (V4's hc_mult); the references take any hc.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, splits_for, use_autograd_triton, use_triton, wide
from engine.kernels.norm import rms_normalize, tile_elements


class HcMix(NamedTuple):
    """The mixes of streams [N, hc, D] with fn [M, hc*D], split over K = hc*D: dots [N, M, S] and sums of squares
    [N, S], fp32 (or wider, with wider streams). hc_pre / hc_head add the S splits and scale by 1/rms."""

    dots: torch.Tensor
    sq: torch.Tensor


def hc_mix_reference(streams: torch.Tensor, fn: torch.Tensor) -> HcMix:
    flat = wide(streams.flatten(1))
    return HcMix((flat @ fn.to(flat.dtype).T)[:, :, None], flat.square().sum(-1)[:, None])


def _normalized_mixes(streams, fn, norm_eps, mix: HcMix | None) -> torch.Tensor:
    """rms_normalize(flattened streams) @ fn^T [N, M] fp32, or the same from its split sums (`mix`), summed in their
    own precision: a float64 model's mixes stay float64, so they do not depend on how its tokens were chunked."""
    if mix is None:
        flat = wide(streams.flatten(1))
        return rms_normalize(flat, norm_eps) @ fn.to(flat.dtype).T
    inv_rms = torch.rsqrt(mix.sq.sum(-1) / fn.shape[1] + norm_eps)
    return mix.dots.sum(-1) * inv_rms[:, None]


def hc_pre_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
    mix: HcMix | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, hc, D]; fn [(2+hc)*hc, hc*D], base [(2+hc)*hc], scale [3] fp32 -> (sublayer input [N, D] in the
    streams' dtype, post [N, hc], comb [N, hc, hc] fp32). `mix`: the streams' mixes with fn, when already made."""
    hc = streams.shape[1]
    mixes = _normalized_mixes(streams, fn, norm_eps, mix)  # [N, (2+hc)*hc]
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = sinkhorn(mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc), hc_eps,
                    sinkhorn_iters)  # fmt: skip
    x = (pre.unsqueeze(-1) * wide(streams)).sum(dim=1)
    return x.to(streams.dtype), post, comb


def sinkhorn_reference(logits: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """logits [N, hc, hc] -> comb [N, hc, hc]: a softmax over each row, then column and row normalisations in turn
    (`iters` column ones), each sum with hc_eps added."""
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):  # alternate row and column normalisation
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    return comb


def sinkhorn_triton(logits: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """sinkhorn_reference in one launch forward and one backward (fp32, hc a power of two): the reference's ~6
    launches an iteration, and twice as many in its backward, are most of a training step's mHC (the demo model's
    training, where hc_pre is the reference)."""
    return _Sinkhorn.apply(logits.contiguous(), hc_eps, iters)


def sinkhorn(logits: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
    """The differentiable kernel only where a backward is wanted of the references (FLASHGATE_KERNELS=autograd):
    the served hc_pre is hc_pre_triton, and the reference stays plain torch as the kernels' oracle."""
    use = use_autograd_triton(logits.device) and logits.dtype == torch.float32
    return (sinkhorn_triton if use else sinkhorn_reference)(logits, hc_eps, iters)


class _Sinkhorn(torch.autograd.Function):
    """Its forward keeps each normalisation's divisors ([N, 2 * iters - 1, hc]); the backward walks them back from
    comb: a normalisation y = x / (s + eps), s the sum of x over the group, has x = y * (s + eps) and
    dx = (dy - sum(dy * y)) / (s + eps), and the softmax p has dlogits = p * (dp - sum(dp * p))."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, hc_eps: float, iters: int) -> torch.Tensor:
        n, hc = logits.shape[0], logits.shape[-1]
        comb = torch.empty_like(logits)
        divisors = torch.empty(n, 2 * iters - 1, hc, dtype=logits.dtype, device=logits.device)
        _sinkhorn_forward_kernel[(triton.cdiv(n, SINKHORN_BLOCK_N),)](
            logits, comb, divisors, n, hc_eps, HC=hc, ITERS=iters, BLOCK_N=SINKHORN_BLOCK_N
        )
        ctx.save_for_backward(comb, divisors)
        ctx.hc_eps, ctx.iters = hc_eps, iters
        return comb

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        comb, divisors = ctx.saved_tensors
        n, hc = comb.shape[0], comb.shape[-1]
        grad_logits = torch.empty_like(comb)
        _sinkhorn_backward_kernel[(triton.cdiv(n, SINKHORN_BLOCK_N),)](
            grad.contiguous(), comb, divisors, grad_logits, n, ctx.hc_eps, HC=hc, ITERS=ctx.iters,
            BLOCK_N=SINKHORN_BLOCK_N,
        )  # fmt: skip
        return grad_logits, None, None


SINKHORN_BLOCK_N = 64


@triton.jit(do_not_specialize=["n_tokens"])
def _sinkhorn_forward_kernel(
    logits_ptr, comb_ptr, div_ptr, n_tokens, hc_eps, HC: tl.constexpr, ITERS: tl.constexpr, BLOCK_N: tl.constexpr
):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i, j = tl.arange(0, HC), tl.arange(0, HC)
    at = n[:, None, None] * HC * HC + i[None, :, None] * HC + j[None, None, :]
    live = n[:, None, None] < n_tokens
    x = tl.load(logits_ptr + at, mask=live, other=0.0)
    x = tl.exp(x - tl.max(x, axis=2)[:, :, None])
    x = x / tl.sum(x, axis=2)[:, :, None] + hc_eps
    steps = 2 * ITERS - 1
    div_at = n[:, None] * steps * HC + tl.arange(0, HC)[None, :]
    div_live = n[:, None] < n_tokens
    column = tl.sum(x, axis=1) + hc_eps  # [BLOCK_N, HC]: divides column j
    tl.store(div_ptr + div_at, column, mask=div_live)
    x = x / column[:, None, :]
    for it in range(ITERS - 1):
        row = tl.sum(x, axis=2) + hc_eps
        tl.store(div_ptr + div_at + (2 * it + 1) * HC, row, mask=div_live)
        x = x / row[:, :, None]
        column = tl.sum(x, axis=1) + hc_eps
        tl.store(div_ptr + div_at + (2 * it + 2) * HC, column, mask=div_live)
        x = x / column[:, None, :]
    tl.store(comb_ptr + at, x, mask=live)


@triton.jit(do_not_specialize=["n_tokens"])
def _sinkhorn_backward_kernel(
    grad_ptr, comb_ptr, div_ptr, out_ptr, n_tokens, hc_eps, HC: tl.constexpr, ITERS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    i, j = tl.arange(0, HC), tl.arange(0, HC)
    at = n[:, None, None] * HC * HC + i[None, :, None] * HC + j[None, None, :]
    live = n[:, None, None] < n_tokens
    y = tl.load(comb_ptr + at, mask=live, other=1.0)
    g = tl.load(grad_ptr + at, mask=live, other=0.0)
    steps = 2 * ITERS - 1
    div_at = n[:, None] * steps * HC + tl.arange(0, HC)[None, :]
    div_live = n[:, None] < n_tokens
    for back in range(ITERS - 1):
        it = ITERS - 2 - back
        column = tl.load(div_ptr + div_at + (2 * it + 2) * HC, mask=div_live, other=1.0)[:, None, :]
        g = (g - tl.sum(g * y, axis=1)[:, None, :]) / column
        y = y * column
        row = tl.load(div_ptr + div_at + (2 * it + 1) * HC, mask=div_live, other=1.0)[:, :, None]
        g = (g - tl.sum(g * y, axis=2)[:, :, None]) / row
        y = y * row
    column = tl.load(div_ptr + div_at, mask=div_live, other=1.0)[:, None, :]
    g = (g - tl.sum(g * y, axis=1)[:, None, :]) / column
    p = y * column - hc_eps  # the softmax
    tl.store(out_ptr + at, p * (g - tl.sum(g * p, axis=2)[:, :, None]), mask=live)


def hc_post_reference(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_j = post_j * F + sum_i comb[i, j] * H_i: out (F) [N, D], streams [N, hc, D] -> new streams."""
    mixed = post.unsqueeze(-1) * wide(out).unsqueeze(1) + torch.einsum("nij,nid->njd", comb, wide(streams))
    return mixed.to(streams.dtype)


def hc_post_mix_reference(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, HcMix]:
    """hc_post, and the new streams' mixes with the next hc_pre's (or hc_head's) fn."""
    new = hc_post_reference(out, streams, post, comb)
    return new, hc_mix_reference(new, fn)


def hc_head_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    mix: HcMix | None = None,
) -> torch.Tensor:
    """streams [N, hc, D]; fn [hc, hc*D], base [hc], scale [1] -> sum_i (sigmoid(...) + hc_eps) H_i [N, D]."""
    pre = torch.sigmoid(_normalized_mixes(streams, fn, norm_eps, mix) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * wide(streams)).sum(dim=1).to(streams.dtype)


@triton.jit(do_not_specialize=["n_tokens"])  # one variant for any token count (see engine/kernels/moe.py)
def _hc_streams_kernel(
    f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, fn_ptr, mix_ptr, sq_ptr, n_tokens,
    HC: tl.constexpr, D: tl.constexpr, MIX: tl.constexpr, CHUNK: tl.constexpr, WITH_POST: tl.constexpr,
    WITH_MIX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_MIX: tl.constexpr,
):  # fmt: skip
    """Over split s's columns d of every stream j: with WITH_POST, X_j = post_j F + sum_i comb[i, j] H_i -> out;
    else X_j = H_j. With WITH_MIX, X.X -> sq[n, s] and X @ fn^T -> mix[n, :, s] (columns j*D + d of fn).
    Every tile is [BLOCK_N, 1 or BLOCK_MIX, BLOCK_D] in one layout: the products accumulate elementwise and are
    summed over D once, at the end (at decode batch sizes a 16-row tl.dot would mostly multiply padding)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_MIX)[None, :, None]
    live = (n < n_tokens)[:, None, None]
    row = n[:, None, None].to(tl.int64)
    acc = tl.zeros((BLOCK_N, BLOCK_MIX, BLOCK_D), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N, 1, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, CHUNK, BLOCK_D):
        d = (split * CHUNK + d0 + tl.arange(0, BLOCK_D))[None, None, :]
        mask = live & (d < D)  # [BLOCK_N, 1, BLOCK_D]
        if WITH_POST:
            f = tl.load(f_ptr + row * D + d, mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(HC):
            if WITH_POST:
                x = tl.load(post_ptr + row * HC + j, mask=live, other=0.0) * f
                for i in tl.static_range(HC):
                    comb_ij = tl.load(comb_ptr + row * (HC * HC) + i * HC + j, mask=live, other=0.0)
                    x += comb_ij * tl.load(h_ptr + (row * HC + i) * D + d, mask=mask, other=0.0).to(tl.float32)
                x = x.to(out_ptr.dtype.element_ty)
                tl.store(out_ptr + (row * HC + j) * D + d, x, mask=mask)
                x = x.to(tl.float32)  # the mixes see the stored (rounded) streams, as the next hc_pre would
            else:
                x = tl.load(h_ptr + (row * HC + j) * D + d, mask=mask, other=0.0).to(tl.float32)
            if WITH_MIX:
                w = tl.load(fn_ptr + m * (HC * D) + j * D + d, mask=(m < MIX) & (d < D), other=0.0)  # [1, M, BD]
                acc += x * w
                sq += x * x
    if WITH_MIX:  # mix [N, MIX, SPLITS], sq [N, SPLITS]: a token's splits of one mix lie side by side
        splits = tl.num_programs(1)
        mm = tl.arange(0, BLOCK_MIX)[None, :]
        mix_offs = (n[:, None] * MIX + mm) * splits + split
        tl.store(mix_ptr + mix_offs, tl.sum(acc, axis=2), mask=(n < n_tokens)[:, None] & (mm < MIX))
        tl.store(sq_ptr + n * splits + split, tl.sum(tl.sum(sq, axis=2), axis=1), mask=n < n_tokens)


@triton.jit(do_not_specialize=["n_tokens"])
def _hc_mix_kernel(
    h_ptr, fn_ptr, mix_ptr, sq_ptr, n_tokens,
    K: tl.constexpr, MIX: tl.constexpr, CHUNK: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_MIX: tl.constexpr,
):  # fmt: skip
    """The mixes of a prefill chunk's streams: over split s's K chunk of the flattened streams x [N, K], x.x ->
    sq[n, s] and x @ fn^T -> mix[n, :, s] (tl.dot over 16+ rows)."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    m = tl.arange(0, BLOCK_MIX)
    live = n < n_tokens
    dots = tl.zeros((BLOCK_N, BLOCK_MIX), dtype=tl.float32)
    sq = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(split * CHUNK, (split + 1) * CHUNK, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        in_k = k < K
        x = tl.load(h_ptr + n[:, None].to(tl.int64) * K + k[None, :], mask=live[:, None] & in_k[None, :], other=0.0)
        x = x.to(tl.float32)
        w = tl.load(fn_ptr + m[None, :] * K + k[:, None], mask=(m[None, :] < MIX) & in_k[:, None], other=0.0)
        # Three TF32 products (x's bf16 values are exact in TF32, fn's fp32 ones a TF32 pair): fp32's precision on the
        # tensor cores ("ieee" runs on the FP32 units, a third as fast; one TF32 product costs ~3e-4 on the mixes)
        dots = tl.dot(x, w, dots, input_precision="tf32x3")
        sq += tl.sum(x * x, axis=1)
    mix_offs = (n[:, None] * MIX + m[None, :]) * SPLITS + split
    tl.store(mix_ptr + mix_offs, dots, mask=live[:, None] & (m[None, :] < MIX))
    tl.store(sq_ptr + n * SPLITS + split, sq, mask=live)


# Up to this many tokens (decode batches) the mixes come from `_hc_streams_kernel`, fused with hc_post; above (a
# prefill chunk), from `_hc_mix_kernel`'s tl.dot, after a plain hc_post.
FUSED_MIX_TOKENS = 64


def _hc_mix_prefill(streams: torch.Tensor, fn: torch.Tensor) -> HcMix:
    n_tokens, hc, dim = streams.shape
    k, mix, tile = hc * dim, fn.shape[0], tile_elements()
    block_n = max(16, min(triton.next_power_of_2(n_tokens), tile // 64))  # tl.dot takes at least 16 rows
    n_blocks = triton.cdiv(n_tokens, block_n)
    # Splits for the power of two above the blocks: the tiling (the compiled variant) follows that of N alone.
    splits = min(splits_for(triton.next_power_of_2(n_blocks), streams.device, waves=4, cap=64), max(1, k // 64))
    chunk = triton.cdiv(k, splits)
    block_k = min(triton.next_power_of_2(chunk), max(16, tile // block_n))
    chunk = triton.cdiv(chunk, block_k) * block_k
    splits = triton.cdiv(k, chunk)
    mixes = HcMix(
        torch.empty(n_tokens, mix, splits, dtype=torch.float32, device=streams.device),
        torch.empty(n_tokens, splits, dtype=torch.float32, device=streams.device),
    )
    _hc_mix_kernel[(n_blocks, splits)](
        streams, fn, *mixes, n_tokens, K=k, MIX=mix, CHUNK=chunk, SPLITS=splits, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_MIX=max(16, triton.next_power_of_2(mix)),
    )  # fmt: skip
    return mixes


def _hc_streams_triton(out, streams, post, comb, fn) -> tuple[torch.Tensor | None, HcMix | None]:
    """`_hc_streams_kernel`: hc_post when out is given, the mixes with fn when fn is given (up to
    FUSED_MIX_TOKENS tokens)."""
    streams = streams.contiguous()
    n_tokens, hc, dim = streams.shape
    with_post, with_mix = out is not None, fn is not None
    tile = tile_elements()
    if with_mix:  # a few hundred programs, each over a contiguous block of every stream
        mix = fn.shape[0]
        block_n, block_mix = min(triton.next_power_of_2(n_tokens), 8), max(2, triton.next_power_of_2(mix))
        splits = min(triton.next_power_of_2(dim) // 16, 256 // triton.next_power_of_2(triton.cdiv(n_tokens, block_n)))
        if interpreting():  # the CPU interpreter pays per program; four still exercise the split sums
            splits = min(splits, 4)
        block_d = triton.next_power_of_2(triton.cdiv(dim, max(1, splits)))
        block_d = max(16, min(block_d, tile // (block_mix * block_n)))
    else:  # hc_post alone
        mix, block_mix = 1, 2
        block_d = min(triton.next_power_of_2(dim), tile // hc)
        block_n = max(1, min(triton.next_power_of_2(n_tokens), tile // (hc * block_d)))
        splits = triton.cdiv(dim, block_d)
    chunk = triton.cdiv(triton.cdiv(dim, max(1, splits)), block_d) * block_d
    splits = triton.cdiv(dim, chunk)
    new = torch.empty_like(streams) if with_post else None
    mixes = None
    if with_mix:
        mixes = HcMix(
            torch.empty(n_tokens, mix, splits, dtype=torch.float32, device=streams.device),
            torch.empty(n_tokens, splits, dtype=torch.float32, device=streams.device),
        )
    unused = streams  # stands for the pointers a variant does not touch
    _hc_streams_kernel[(triton.cdiv(n_tokens, block_n), splits)](
        out.contiguous() if with_post else unused, streams, post if with_post else unused,
        comb if with_post else unused, new if with_post else unused, fn if with_mix else unused,
        *(mixes or (unused, unused)), n_tokens, HC=hc, D=dim, MIX=mix, CHUNK=chunk, WITH_POST=with_post,
        WITH_MIX=with_mix, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_MIX=block_mix,
    )  # fmt: skip
    return new, mixes


def hc_mix_triton(streams: torch.Tensor, fn: torch.Tensor) -> HcMix:
    if streams.shape[0] > FUSED_MIX_TOKENS:
        return _hc_mix_prefill(streams.contiguous(), fn)
    return _hc_streams_triton(None, streams, None, None, fn)[1]


def hc_post_triton(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return _hc_streams_triton(out, streams, post, comb, None)[0]


def hc_post_mix_triton(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, HcMix]:
    if streams.shape[0] > FUSED_MIX_TOKENS:  # a prefill chunk: two passes, each at its best tiling
        new = hc_post_triton(out, streams, post, comb)
        return new, _hc_mix_prefill(new, fn)
    return _hc_streams_triton(out, streams, post, comb, fn)


@triton.jit
def _softmax4(a, b, c, d, hc_eps):
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - top), tl.exp(b - top), tl.exp(c - top), tl.exp(d - top)
    total = a + b + c + d
    return a / total + hc_eps, b / total + hc_eps, c / total + hc_eps, d / total + hc_eps


@triton.jit
def _normalize4(a, b, c, d, hc_eps):
    total = a + b + c + d + hc_eps
    return a / total, b / total, c / total, d / total


@triton.jit
def _sinkhorn4(
    c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33, hc_eps,
    ITERS: tl.constexpr,
):  # fmt: skip
    """hc_pre_reference's softmax over rows then alternating column / row normalisation of a 4x4 comb, one value
    per entry: every sum is a thread's own additions (no reductions across threads, which would serialise 40
    shuffle rounds)."""
    c00, c01, c02, c03 = _softmax4(c00, c01, c02, c03, hc_eps)
    c10, c11, c12, c13 = _softmax4(c10, c11, c12, c13, hc_eps)
    c20, c21, c22, c23 = _softmax4(c20, c21, c22, c23, hc_eps)
    c30, c31, c32, c33 = _softmax4(c30, c31, c32, c33, hc_eps)
    c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, hc_eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _normalize4(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _normalize4(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _normalize4(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _normalize4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _normalize4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _normalize4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _normalize4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _normalize4(c03, c13, c23, c33, hc_eps)
    return c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33


@triton.jit
def _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS: tl.constexpr, k: tl.constexpr):
    """comb entry k = i * 4 + j before the softmax: [BLOCK_N]."""
    logit = tl.sum(tl.load(part_mix + (8 + k) * SPLITS, mask=live_part, other=0.0), axis=1)
    return logit * scale + tl.load(base_ptr + 8 + k)


@triton.jit(do_not_specialize=["n_tokens"])
def _hc_weights_kernel(
    h_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, n_tokens, hc_eps, norm_eps,
    HC: tl.constexpr, D: tl.constexpr, MIX: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
    SINKHORN_ITERS: tl.constexpr, WITH_COMB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """pre (and post, comb) of a block of tokens from the split sums; x = sum_i pre_i H_i over one block of D.
    Every block of D computes the weights (cheap: no reduction across threads in the Sinkhorn loop); one stores
    post and comb."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_tokens
    i = tl.arange(0, HC)
    s = tl.arange(0, BLOCK_S)
    live_part = live[:, None] & (s[None, :] < SPLITS)  # [BLOCK_N, BLOCK_S]
    sq = tl.sum(tl.load(sq_ptr + n[:, None] * SPLITS + s[None, :], mask=live_part, other=0.0), axis=1)
    inv_rms = tl.rsqrt(sq / (HC * D) + norm_eps)
    part_mix = mix_ptr + n[:, None] * (MIX * SPLITS) + s[None, :]  # mix column c at part_mix + c * SPLITS
    pre = tl.load(part_mix[:, None, :] + i[None, :, None] * SPLITS, mask=live_part[:, None, :], other=0.0)
    pre = tl.sum(pre, axis=2) * inv_rms[:, None] * tl.load(scale_ptr)
    pre = tl.sigmoid(pre + tl.load(base_ptr + i)[None, :]) + hc_eps
    if WITH_COMB:
        tl.static_assert(HC == 4, "the Triton hc_pre's Sinkhorn is written out for hc = 4")
        first = live & (tl.program_id(1) == 0)  # every block of D computes the weights; one stores them
        post = tl.load(part_mix[:, None, :] + (HC + i[None, :, None]) * SPLITS, mask=live_part[:, None, :], other=0.0)
        post = tl.sum(post, axis=2) * inv_rms[:, None] * tl.load(scale_ptr + 1)
        post = 2 * tl.sigmoid(post + tl.load(base_ptr + HC + i)[None, :])
        tl.store(post_ptr + n[:, None] * HC + i[None, :], post, mask=first[:, None])
        scale = inv_rms * tl.load(scale_ptr + 2)
        comb = _sinkhorn4(
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 0),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 1),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 2),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 3),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 4),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 5),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 6),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 7),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 8),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 9),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 10),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 11),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 12),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 13),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 14),
            _comb_logit(part_mix, live_part, base_ptr, scale, SPLITS, 15),
            hc_eps, SINKHORN_ITERS,
        )  # fmt: skip
        for k in tl.static_range(16):
            tl.store(comb_ptr + n * 16 + k, comb[k], mask=first)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    h_offs = (n[:, None, None].to(tl.int64) * HC + i[None, :, None]) * D + d[None, None, :]
    h = tl.load(h_ptr + h_offs, mask=live[:, None, None] & in_d[None, None, :], other=0.0).to(tl.float32)
    x = tl.sum(pre[:, :, None] * h, axis=1)
    x_offs = n[:, None].to(tl.int64) * D + d[None, :]
    tl.store(x_ptr + x_offs, x.to(x_ptr.dtype.element_ty), mask=live[:, None] & in_d[None, :])


def _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, with_comb: bool, mix):
    """The weights and the weighted sum of hc_pre (with_comb) or hc_head: (x [N, D], post [N, hc], comb [N, hc, hc])
    from the mixes (made here when `mix` is None)."""
    streams = streams.contiguous()
    if mix is None:
        mix = hc_mix_triton(streams, fn)
    n_tokens, hc, dim = streams.shape
    splits, device, tile = mix.dots.shape[-1], streams.device, tile_elements()
    x = torch.empty(n_tokens, dim, dtype=streams.dtype, device=device)
    if with_comb:
        post = torch.empty(n_tokens, hc, dtype=torch.float32, device=device)
        comb = torch.empty(n_tokens, hc, hc, dtype=torch.float32, device=device)
    else:  # hc_head: no post weights or comb to store
        post = comb = x
    block_s = triton.next_power_of_2(splits)
    if n_tokens <= FUSED_MIX_TOKENS:  # many splits: few tokens a program, up to 16-64 blocks of D
        block_n = max(1, min(triton.next_power_of_2(n_tokens), tile // (block_s * hc * hc)))
        block_d = max(1, min(triton.next_power_of_2(dim), 256 if n_tokens <= 16 else 1024, tile // (hc * block_n)))
    else:  # a prefill chunk: wide blocks of D, so that few programs redo a token's weights
        block_d = min(triton.next_power_of_2(dim), tile // hc)
        block_n = max(1, min(triton.next_power_of_2(n_tokens), tile // (hc * block_d), tile // (block_s * hc * hc)))
    _hc_weights_kernel[(triton.cdiv(n_tokens, block_n), triton.cdiv(dim, block_d))](
        streams, mix.dots, mix.sq, base, scale, x, post, comb, n_tokens, hc_eps, norm_eps, HC=hc, D=dim,
        MIX=fn.shape[0], SPLITS=splits, BLOCK_S=block_s, SINKHORN_ITERS=sinkhorn_iters, WITH_COMB=with_comb,
        BLOCK_N=block_n, BLOCK_D=block_d, num_warps=1 if n_tokens <= 16 else 4,  # measured on the H200
    )  # fmt: skip
    return x, post, comb


def hc_pre_triton(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
    mix: HcMix | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, True, mix)


def hc_head_triton(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    mix: HcMix | None = None,
) -> torch.Tensor:
    return _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, 0, False, mix)[0]


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
    mix: HcMix | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = hc_pre_triton if use_triton(streams.device) else hc_pre_reference
    return impl(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, mix)


def hc_post_mix(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, fn: torch.Tensor
) -> tuple[torch.Tensor, HcMix]:
    """hc_post of one sublayer fused with the mixes of the next hc_pre (or hc_head) whose weights are `fn`: pass
    the mixes on as that call's `mix`."""
    impl = hc_post_mix_triton if use_triton(streams.device) else hc_post_mix_reference
    return impl(out, streams, post, comb, fn)


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    mix: HcMix | None = None,
) -> torch.Tensor:
    impl = hc_head_triton if use_triton(streams.device) else hc_head_reference
    return impl(streams, fn, base, scale, hc_eps, norm_eps, mix)
