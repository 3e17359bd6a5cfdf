"""mHC (reference §4): hc_pre mixes the `hc` residual streams into a sublayer's input and makes the sublayer's post
weights and the doubly-stochastic comb; hc_post writes the sublayer's output back into the streams; hc_head
collapses the streams once before the final norm.

Plain torch spends ~140 launches on one hc_pre (20 Sinkhorn iterations of sums and divisions on a 4x4 matrix), ~6
on hc_post and ~17 on hc_head. The Triton path is two kernels for hc_pre and hc_head, one for hc_post:
  `_hc_mix_kernel`: per block of tokens and split of K = hc * D, the partial sum of squares of the flattened streams
      and their partial dot products with the mixing weights fn (a split-K GEMV, fn read once per program), fp32.
  `_hc_weights_kernel`: per token, sums the splits, scales by 1/rms, takes the sigmoids and, for hc_pre, the softmax
      and Sinkhorn iterations on the hc x hc comb in registers; then the pre-weighted sum of the streams over its
      block of D. Splits are summed in a fixed order: the result does not depend on timing.
  `_hc_post_kernel`: out[n, j] = post[n, j] * F[n] + sum_i comb[n, i, j] * streams[n, i], per block of D.
hc must be a power of two (it is 4).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import splits_for, use_triton
from engine.kernels.norm import rms_normalize, tile_elements


def hc_pre_reference(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """streams [N, hc, D]; fn [(2+hc)*hc, hc*D], base [(2+hc)*hc], scale [3] fp32 -> (sublayer input [N, D] in the
    streams' dtype, post [N, hc], comb [N, hc, hc] fp32)."""
    hc = streams.shape[1]
    flat = rms_normalize(streams.flatten(1).float(), norm_eps)
    mixes = flat @ fn.T  # [N, (2+hc)*hc]
    pre = torch.sigmoid(mixes[:, :hc] * scale[0] + base[:hc]) + hc_eps
    post = 2 * torch.sigmoid(mixes[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    comb = mixes[:, 2 * hc :].view(-1, hc, hc) * scale[2] + base[2 * hc :].view(hc, hc)
    comb = torch.softmax(comb, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):  # alternate row and column normalisation
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    x = (pre.unsqueeze(-1) * streams.float()).sum(dim=1)
    return x.to(streams.dtype), post, comb


def hc_post_reference(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """H'_j = post_j * F + sum_i comb[i, j] * H_i: out (F) [N, D], streams [N, hc, D] -> new streams."""
    mixed = post.unsqueeze(-1) * out.float().unsqueeze(1) + torch.einsum("nij,nid->njd", comb, streams.float())
    return mixed.to(streams.dtype)


def hc_head_reference(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    """streams [N, hc, D]; fn [hc, hc*D], base [hc], scale [1] -> sum_i (sigmoid(...) + hc_eps) H_i [N, D]."""
    flat = rms_normalize(streams.flatten(1).float(), norm_eps)
    pre = torch.sigmoid((flat @ fn.T) * scale + base) + hc_eps
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype)


@triton.jit
def _hc_mix_kernel(
    h_ptr, fn_ptr, mix_ptr, sq_ptr, n_tokens,
    K: tl.constexpr, MIX: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_MIX: tl.constexpr,
):  # fmt: skip
    """Over split s's K chunk of the flattened streams x [N, K]: x.x -> sq[s, n] and x @ fn^T -> mix[s, n, :]."""
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
        dots = tl.dot(x, w, dots, input_precision="ieee")  # TF32 would cost ~3e-4 on the mixes
        sq += tl.sum(x * x, axis=1)
    part = split * n_tokens + n
    tl.store(mix_ptr + part[:, None] * MIX + m[None, :], dots, mask=live[:, None] & (m[None, :] < MIX))
    tl.store(sq_ptr + part, sq, mask=live)


@triton.jit
def _hc_weights_kernel(
    h_ptr, mix_ptr, sq_ptr, base_ptr, scale_ptr, x_ptr, post_ptr, comb_ptr, n_tokens, hc_eps, norm_eps,
    HC: tl.constexpr, D: tl.constexpr, MIX: tl.constexpr, SPLITS: tl.constexpr, SINKHORN_ITERS: tl.constexpr,
    WITH_COMB: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """pre (and post, comb) of a block of tokens from the split sums; x = sum_i pre_i H_i over one block of D."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    live = n < n_tokens
    i = tl.arange(0, HC)
    part = tl.arange(0, SPLITS)[None, :] * n_tokens + n[:, None]  # [BLOCK_N, SPLITS]
    sq = tl.sum(tl.load(sq_ptr + part, mask=live[:, None], other=0.0), axis=1)
    inv_rms = tl.rsqrt(sq / (HC * D) + norm_eps)
    part_mix = mix_ptr + part[:, :, None] * MIX  # [BLOCK_N, SPLITS, 1]
    pre = tl.sum(tl.load(part_mix + i[None, None, :], mask=live[:, None, None], other=0.0), axis=1)
    pre = tl.sigmoid(pre * inv_rms[:, None] * tl.load(scale_ptr) + tl.load(base_ptr + i)[None, :]) + hc_eps
    if WITH_COMB:
        post = tl.sum(tl.load(part_mix + HC + i[None, None, :], mask=live[:, None, None], other=0.0), axis=1)
        post = 2 * tl.sigmoid(post * inv_rms[:, None] * tl.load(scale_ptr + 1) + tl.load(base_ptr + HC + i)[None, :])
        ij = i[:, None] * HC + i[None, :]  # comb[i, j]: from stream i to stream j
        comb = tl.load(part_mix[:, :, :, None] + 2 * HC + ij[None, None, :, :], mask=live[:, None, None, None],
                       other=0.0)  # fmt: skip
        comb = tl.sum(comb, axis=1) * inv_rms[:, None, None] * tl.load(scale_ptr + 2)
        comb += tl.load(base_ptr + 2 * HC + ij)[None, :, :]
        comb = tl.exp(comb - tl.max(comb, axis=2)[:, :, None])
        comb = comb / tl.sum(comb, axis=2)[:, :, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        for _ in range(SINKHORN_ITERS - 1):  # alternate row and column normalisation
            comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
        first = tl.program_id(1) == 0  # every block of D computes the weights; one stores them
        tl.store(post_ptr + n[:, None] * HC + i[None, :], post, mask=live[:, None] & first)
        tl.store(comb_ptr + n[:, None, None] * (HC * HC) + ij[None, :, :], comb, mask=live[:, None, None] & first)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    in_d = d < D
    h_offs = (n[:, None, None].to(tl.int64) * HC + i[None, :, None]) * D + d[None, None, :]
    h = tl.load(h_ptr + h_offs, mask=live[:, None, None] & in_d[None, None, :], other=0.0).to(tl.float32)
    x = tl.sum(pre[:, :, None] * h, axis=1)
    x_offs = n[:, None].to(tl.int64) * D + d[None, :]
    tl.store(x_ptr + x_offs, x.to(x_ptr.dtype.element_ty), mask=live[:, None] & in_d[None, :])


def _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, with_comb: bool):
    """Both kernels of hc_pre (with_comb) or hc_head: (x [N, D], post [N, hc], comb [N, hc, hc])."""
    streams = streams.contiguous()
    n_tokens, hc, dim = streams.shape
    k, mix = hc * dim, fn.shape[0]
    device, tile = streams.device, tile_elements()
    block_n = max(16, min(triton.next_power_of_2(n_tokens), tile // 64))  # tl.dot takes at least 16 rows
    n_blocks = triton.cdiv(n_tokens, block_n)
    splits = min(splits_for(n_blocks, device, waves=1, cap=64), max(1, k // 64))
    splits = 1 << (splits.bit_length() - 1)  # a power of two: the second kernel loads all splits at once
    chunk = triton.cdiv(k, splits)
    block_k = min(triton.next_power_of_2(chunk), max(16, tile // block_n))
    chunk = triton.cdiv(chunk, block_k) * block_k
    mixes = torch.empty(splits, n_tokens, mix, dtype=torch.float32, device=device)
    sq = torch.empty(splits, n_tokens, dtype=torch.float32, device=device)
    _hc_mix_kernel[(n_blocks, splits)](
        streams, fn, mixes, sq, n_tokens, K=k, MIX=mix, CHUNK=chunk, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_MIX=max(16, triton.next_power_of_2(mix)),
    )  # fmt: skip
    x = torch.empty(n_tokens, dim, dtype=streams.dtype, device=device)
    if with_comb:
        post = torch.empty(n_tokens, hc, dtype=torch.float32, device=device)
        comb = torch.empty(n_tokens, hc, hc, dtype=torch.float32, device=device)
    else:  # hc_head: no post weights or comb to store
        post = comb = x
    block_d = min(triton.next_power_of_2(dim), tile // hc)
    block_n = max(1, min(triton.next_power_of_2(n_tokens), tile // (hc * block_d), tile // (splits * hc * hc)))
    _hc_weights_kernel[(triton.cdiv(n_tokens, block_n), triton.cdiv(dim, block_d))](
        streams, mixes, sq, base, scale, x, post, comb, n_tokens, hc_eps, norm_eps, HC=hc, D=dim, MIX=mix,
        SPLITS=splits, SINKHORN_ITERS=sinkhorn_iters, WITH_COMB=with_comb, BLOCK_N=block_n, BLOCK_D=block_d,
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters, with_comb=True)


def hc_head_triton(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    return _hc_weights_triton(streams, fn, base, scale, hc_eps, norm_eps, 0, with_comb=False)[0]


@triton.jit
def _hc_post_kernel(
    f_ptr, h_ptr, post_ptr, comb_ptr, out_ptr, n_tokens,
    HC: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    j = tl.arange(0, HC)
    live = n < n_tokens
    mask = live[:, None] & (d[None, :] < D)
    row = n[:, None].to(tl.int64)
    f = tl.load(f_ptr + row * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    mixed = tl.zeros((BLOCK_N, HC, BLOCK_D), dtype=tl.float32)
    for i in tl.static_range(HC):
        comb_i = tl.load(comb_ptr + row * (HC * HC) + i * HC + j[None, :], mask=live[:, None], other=0.0)
        h_i = tl.load(h_ptr + (row * HC + i) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        mixed += comb_i[:, :, None] * h_i[:, None, :]
    post = tl.load(post_ptr + row * HC + j[None, :], mask=live[:, None], other=0.0)
    out = post[:, :, None] * f[:, None, :] + mixed
    out_offs = (row[:, :, None] * HC + j[None, :, None]) * D + d[None, None, :]
    tl.store(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), mask=mask[:, None, :])


def hc_post_triton(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    out, streams = out.contiguous(), streams.contiguous()
    n_tokens, hc, dim = streams.shape
    mixed = torch.empty_like(streams)
    tile = tile_elements()
    block_d = min(triton.next_power_of_2(dim), tile // hc)
    block_n = max(1, min(triton.next_power_of_2(n_tokens), tile // (hc * block_d)))
    _hc_post_kernel[(triton.cdiv(n_tokens, block_n), triton.cdiv(dim, block_d))](
        out, streams, post, comb, mixed, n_tokens, HC=hc, D=dim, BLOCK_N=block_n, BLOCK_D=block_d
    )
    return mixed


def hc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    impl = hc_pre_triton if use_triton(streams.device) else hc_pre_reference
    return impl(streams, fn, base, scale, hc_eps, norm_eps, sinkhorn_iters)


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    impl = hc_post_triton if use_triton(streams.device) else hc_post_reference
    return impl(out, streams, post, comb)


def hc_head(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float, norm_eps: float
) -> torch.Tensor:
    impl = hc_head_triton if use_triton(streams.device) else hc_head_reference
    return impl(streams, fn, base, scale, hc_eps, norm_eps)
