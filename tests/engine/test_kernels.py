"""Each Triton kernel against its plain-torch reference, run by Triton's interpreter on the CPU at small sizes:
lengths 0, 1, not a multiple of the page, exactly k, past k; bf16 and FP8 rows."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import IndexKeys, MainRows
from engine.kernels.compressor import (
    compress_chunk_reference,
    compress_chunk_triton,
    compressor_decode_step_reference,
    compressor_decode_step_triton,
)
from engine.kernels.indexer import indexer_logits_reference, indexer_logits_triton
from engine.kernels.sparse_attention import (
    LAUNCHES,
    sparse_decode_attention_reference,
    sparse_decode_attention_triton,
)
from engine.kernels.topk import topk_slots_reference, topk_slots_triton
from engine.model.layers import rope_inv_freq

# tests/conftest.py selects Triton's interpreter on CPU machines; on a GPU tests/gpu runs the same checks at size.
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

KV_DTYPES = ["bfloat16", "fp8_e4m3"]


def _page_tables(batch: int, pages_each: int, num_pages: int, gen: torch.Generator) -> torch.Tensor:
    return torch.stack([torch.randperm(num_pages, generator=gen)[:pages_each] for _ in range(batch)]).int()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("splits", [1, 3, 8])  # 8 splits leave some programs without pages
def test_indexer_logits(kv_dtype, splits):
    gen = torch.Generator().manual_seed(1)
    batch, heads, dim, pages = 5, 16, 128, 12
    keys = IndexKeys(pages, dim, kv_dtype, "cpu")
    keys.write(torch.arange(pages * 64), torch.randn(pages * 64, dim, generator=gen))
    q = torch.randn(batch, heads, dim, generator=gen).to(torch.bfloat16)
    w = torch.randn(batch, heads, generator=gen)
    table = _page_tables(batch, 5, pages, gen)
    c4_len = torch.tensor([0, 1, 63, 64, 300], dtype=torch.int32)  # empty, one row, partial and full pages
    sentinel = 12345.0
    ref = indexer_logits_reference(q, w, keys.values, keys.scales, table, c4_len, torch.full((batch, 320), sentinel))
    out = indexer_logits_triton(q, w, keys.values, keys.scales, table, c4_len, torch.full((batch, 320), sentinel),
                                splits=splits)  # fmt: skip
    for b, n in enumerate(c4_len.tolist()):
        torch.testing.assert_close(out[b, :n], ref[b, :n], rtol=1e-5, atol=1e-4)
        assert (out[b, n:] == sentinel).all(), "rows past c4_len must not be written"


@pytest.mark.parametrize("k", [8, 64])
def test_topk_slots_bounded_by_length(k):
    gen = torch.Generator().manual_seed(2)
    batch, pages = 6, 10
    logits = torch.randn(batch, pages * 64, generator=gen)
    logits[4] = torch.round(logits[4] * 2) / 2  # many exact ties
    logits[:, 300:] = float("nan")  # past every length: must never be read
    table = _page_tables(batch, pages, pages, gen)
    c4_len = torch.tensor([0, 1, k, k + 1, 300, 257], dtype=torch.int32)
    ref = topk_slots_reference(logits, c4_len, table, k, torch.zeros(batch, k, dtype=torch.int32))
    out = topk_slots_triton(logits, c4_len, table, k, torch.zeros(batch, k, dtype=torch.int32), splits=3)
    for b, n in enumerate(c4_len.tolist()):
        got = out[b].tolist()
        assert got.count(-1) == max(0, k - n)
        if n <= k:  # every valid row, each once
            assert sorted(got) == sorted(ref[b].tolist())
            continue
        # Same multiset of logit values as the reference (rows tied with the k-th value may differ).
        physical_to_row = {int(table[b, p]) * 64 + r: p * 64 + r for p in range(pages) for r in range(64)}
        values = sorted(float(logits[b, physical_to_row[s]]) for s in got)
        assert values == sorted(float(logits[b, physical_to_row[s]]) for s in ref[b].tolist())
        assert len(set(got)) == k


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("ratio_rows", [64, 2])  # c4 pages hold 64 rows, c128 pages 2
@pytest.mark.parametrize("splits", [1, 3])  # one program per request (sink merged in-kernel), or split-K + combine
# the launch picked for this batch (many requests' first), the last (what 99 KB GPUs get), or few requests' first
@pytest.mark.parametrize("launch", ["picked", "last", "few"])
def test_sparse_decode_attention(kv_dtype, ratio_rows, splits, launch):
    _check_sparse_decode_attention(kv_dtype, ratio_rows, splits, launch, heads=8)


@pytest.mark.parametrize("heads", [16, 32])
def test_sparse_decode_attention_at_each_ranks_head_count(heads):
    """V4-Flash's 64 heads split by tensor-parallel attention over 2, 4, 8 ranks: 32, 16 (and 8, above) a rank."""
    _check_sparse_decode_attention("fp8_e4m3", 64, 3, "picked", heads)


def _check_sparse_decode_attention(kv_dtype, ratio_rows, splits, launch, heads):
    gen = torch.Generator().manual_seed(3)
    batch, dim, rope, window, pages, k = 5, 128, 64, 32, 40, 12
    ring = MainRows(batch, window, dim, rope, kv_dtype, "cpu")
    ring.write(torch.arange(batch * window), torch.randn(batch * window, dim, generator=gen))
    comp = MainRows(pages, ratio_rows, dim, rope, kv_dtype, "cpu")
    comp.write(torch.arange(pages * ratio_rows), torch.randn(pages * ratio_rows, dim, generator=gen))
    q = torch.randn(batch, heads, dim, generator=gen).to(torch.bfloat16)
    sink = torch.randn(heads, generator=gen)
    seq_slot = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    positions = torch.tensor([0, 5, 31, 32, 200], dtype=torch.int32)  # window partly filled, full, wrapped
    slots = torch.randint(0, pages * ratio_rows, (batch, k), generator=gen).int()
    comp_len = torch.tensor([0, 1, 7, 12, 12], dtype=torch.int32)
    slots[2, 7:] = -1
    slots[4, 3] = -1  # a hole inside the list is skipped
    args = (q, sink, 128**-0.5, ring.storage, seq_slot, positions, comp.storage, ratio_rows, slots, comp_len)
    ref = sparse_decode_attention_reference(*args, torch.zeros(batch, heads, dim), window, rope)
    fp8 = kv_dtype == "fp8_e4m3"
    launch = {"picked": None, "last": LAUNCHES[fp8, False][-1], "few": LAUNCHES[fp8, True][0]}[launch]
    out = sparse_decode_attention_triton(*args, torch.zeros(batch, heads, dim), window, rope, splits=splits,
                                         launch=launch)  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)  # bf16 queries: the kernel's P@V runs in bf16


@pytest.mark.parametrize(
    ("ratio", "for_indexer", "kv_dtype", "quant_sim"),
    [(4, False, "fp8_e4m3", True), (4, True, "fp8_e4m3", True), (4, False, "float32", False),
     (128, False, "float32", False), (128, False, "fp8_e4m3", True)],
)  # fmt: skip
def test_compressor_decode_step(ratio, for_indexer, kv_dtype, quant_sim):
    gen = torch.Generator().manual_seed(4)
    batch, slots, dim, pages = 3, 4, 128, 8
    coff = 2 if ratio == 4 else 1
    ape = torch.randn(ratio, coff * dim, generator=gen)
    norm = torch.rand(dim, generator=gen) + 0.5
    inv_freq = rope_inv_freq(64, 160000.0, None)
    seq_slot = torch.tensor([2, 0, 3], dtype=torch.int32)
    table = torch.stack([torch.randperm(pages, generator=gen) for _ in range(batch)]).int()
    start = torch.tensor([0, ratio - 3, 3 * ratio - 2])  # first window, a window about to close, a later one

    def run(step_fn):
        out = IndexKeys(pages, dim, kv_dtype, "cpu") if for_indexer else MainRows(pages, 256 // ratio, dim, 64,
                                                                                  kv_dtype, "cpu")  # fmt: skip
        kv_state = torch.zeros(slots, coff * ratio, coff * dim)
        score_state = torch.full((slots, coff * ratio, coff * dim), float("-inf"))
        steps = torch.Generator().manual_seed(5)
        for step in range(ratio + 3 if ratio == 4 else 6):
            kv = torch.randn(batch, coff * dim, generator=steps)
            score = torch.randn(batch, coff * dim, generator=steps)
            step_fn(kv, score, ape, norm, 1e-6, inv_freq, kv_state, score_state, seq_slot, (start + step).int(), table,
                    out.storage, out.rows_per_page, ratio, for_indexer, quant_sim)  # fmt: skip
        return out.read(torch.arange(pages * out.rows_per_page))

    ref, got = run(compressor_decode_step_reference), run(compressor_decode_step_triton)
    _assert_rows_match(got, ref, kv_dtype == "float32" and not quant_sim, flipped=0.05)


def _assert_rows_match(got: torch.Tensor, ref: torch.Tensor, exact: bool, flipped: float) -> None:
    """Compressed rows of a kernel against its reference: fp32 rows closely; quantised ones up to a share `flipped`
    of elements. Triton 3.6's interpreter rounds fp32 -> e4m3 / bf16 its own way (a mantissa carry into the exponent
    is lost), so on the CPU some quantised elements differ; tests/gpu/test_kernels_gpu.py checks the kernels there."""
    assert ref.abs().sum() > 0, "some window closed"
    if exact:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        return
    differ = (ref - got).abs() > 1e-4
    assert differ.float().mean() < flipped
    assert (ref - got).abs().mean() < 0.02 * ref.abs().mean()


@pytest.mark.parametrize(
    ("ratio", "for_indexer", "kv_dtype", "quant_sim", "dtype"),
    [(4, False, "fp8_e4m3", True, torch.bfloat16), (4, True, "fp8_e4m3", True, torch.bfloat16),
     (4, False, "float32", False, torch.float32), (4, True, "float32", False, torch.float32),
     (128, False, "float32", False, torch.float32), (128, False, "fp8_e4m3", True, torch.bfloat16)],
)  # fmt: skip
def test_compress_chunk(ratio, for_indexer, kv_dtype, quant_sim, dtype):
    """A request's prefill chunks: one that closes no window, one that ends a window the state began, several
    windows at once, a chunk ending exactly on a window's end, one token: rows and the state left behind."""
    gen = torch.Generator().manual_seed(6)
    dim, pages = 128, 8
    coff = 2 if ratio == 4 else 1
    ape = torch.randn(ratio, coff * dim, generator=gen)
    norm = torch.rand(dim, generator=gen) + 0.5
    inv_freq = rope_inv_freq(64, 160000.0, None)
    chunks = [3, 2, 3 * ratio + 1, ratio - 1, 1] if ratio == 4 else [ratio - 5, 9, ratio - 4, ratio + 3]
    table = torch.randperm(pages, generator=gen)

    def run(chunk_fn):
        out = IndexKeys(pages, dim, kv_dtype, "cpu") if for_indexer else MainRows(pages, 256 // ratio, dim, 64,
                                                                                  kv_dtype, "cpu")  # fmt: skip
        kv_state = torch.zeros(coff * ratio, coff * dim)
        score_state = torch.full((coff * ratio, coff * dim), float("-inf"))
        inputs, first, states = torch.Generator().manual_seed(7), 0, []
        for length in chunks:
            # rows of a wider projection, as the attention's fused GEMM gives them
            kv = torch.randn(length, 3 * coff * dim, generator=inputs)[:, coff * dim : 2 * coff * dim]
            score = torch.randn(length, coff * dim, generator=inputs)
            rows = torch.arange(first // ratio, (first + length) // ratio)
            slots = table[rows // out.rows_per_page] * out.rows_per_page + rows % out.rows_per_page
            chunk_fn(kv, score, torch.arange(first, first + length), first, kv_state, score_state, ape, norm, 1e-6,
                     inv_freq, out.storage, slots, out.rows_per_page, ratio, for_indexer, quant_sim, dtype)  # fmt: skip
            first += length
            states.append((kv_state.clone(), score_state.clone()))
        return out.read(torch.arange(pages * out.rows_per_page)), states

    (ref, ref_states), (got, got_states) = run(compress_chunk_reference), run(compress_chunk_triton)
    for (ref_kv, ref_score), (got_kv, got_score) in zip(ref_states, got_states, strict=True):
        assert torch.equal(got_kv, ref_kv) and torch.equal(got_score, ref_score)  # copies: exact
    # more flips than a decode step's: a bf16 model's row is rounded three times (pooled, normed, rotated)
    _assert_rows_match(got, ref, kv_dtype == "float32" and not quant_sim, flipped=0.1)
