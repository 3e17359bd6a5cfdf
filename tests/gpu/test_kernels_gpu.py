"""The Triton kernels against their references on a real GPU at V4-Flash sizes (64 heads, head dim 512, indexer
64 x 128, top-k 512), bf16 and FP8 rows."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import IndexKeys, MainRows
from engine.kernels import sparse_attention
from engine.kernels.compressor import (
    compress_chunk_reference,
    compress_chunk_triton,
    compressor_decode_step_reference,
    compressor_decode_step_triton,
)
from engine.kernels.indexer import indexer_logits_reference, indexer_logits_triton
from engine.kernels.quant import fp4_simulate
from engine.kernels.sparse_attention import (
    LAUNCHES,
    sparse_decode_attention_reference,
    sparse_decode_attention_triton,
)
from engine.kernels.topk import topk_slots_reference, topk_slots_triton
from engine.model.layers import rope_inv_freq
from engine.model.weight_formats import Unquantized
from tests.gpu.graphs import capture

pytestmark = pytest.mark.gpu
DEV = "cuda"


def _attention_inputs(kv_dtype: str, batch: int, pages: int, gen: torch.Generator):
    """Random window rings (128 rows a request), c4 pages, queries and sinks at flash sizes."""
    ring = MainRows(batch, 128, 512, 64, kv_dtype, DEV)
    ring.write(torch.arange(batch * 128, device=DEV), torch.randn(batch * 128, 512, device=DEV, generator=gen))
    comp = MainRows(pages, 64, 512, 64, kv_dtype, DEV)
    comp.write(torch.arange(pages * 64, device=DEV), torch.randn(pages * 64, 512, device=DEV, generator=gen))
    q = torch.randn(batch, 64, 512, device=DEV, generator=gen).bfloat16()
    return ring, comp, q, torch.randn(64, device=DEV, generator=gen)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_indexer_topk_attention_at_flash_sizes(kv_dtype):
    gen = torch.Generator(device=DEV).manual_seed(0)
    batch, pages = 4, 200
    keys = IndexKeys(pages, 128, kv_dtype, DEV)
    keys.write(torch.arange(pages * 64, device=DEV), torch.randn(pages * 64, 128, device=DEV, generator=gen))
    table = torch.stack([torch.randperm(pages, device=DEV, generator=gen) for _ in range(batch)]).int()
    c4_len = torch.tensor([0, 300, 512, 12_000], device=DEV, dtype=torch.int32)
    # Index queries as the model makes them: FP4-rounded (exact in e4m3 once scaled by a power of two).
    q = fp4_simulate(torch.randn(batch, 64, 128, device=DEV, generator=gen)).bfloat16()
    w = torch.randn(batch, 64, device=DEV, generator=gen)
    ref = indexer_logits_reference(
        q, w, keys.values, keys.scales, table, c4_len, torch.zeros(batch, pages * 64, device=DEV)
    )
    out = indexer_logits_triton(
        q, w, keys.values, keys.scales, table, c4_len, torch.zeros(batch, pages * 64, device=DEV)
    )
    for b, n in enumerate(c4_len.tolist()):
        torch.testing.assert_close(out[b, :n], ref[b, :n], rtol=2e-2, atol=2e-2)  # bf16 tensor-core dot
    slots_ref = topk_slots_reference(out, c4_len, table, 512, torch.zeros(batch, 512, dtype=torch.int32, device=DEV))
    slots = topk_slots_triton(out, c4_len, table, 512, torch.zeros(batch, 512, dtype=torch.int32, device=DEV))
    for a, b in zip(slots.tolist(), slots_ref.tolist(), strict=True):
        assert sorted(a) == sorted(b)
    ring, comp, qa, sink = _attention_inputs(kv_dtype, batch, pages, gen)
    positions = (c4_len * 4 + 3).int()
    comp_len = c4_len.clamp(max=512)
    args = (qa, sink, 512**-0.5, ring.storage, torch.arange(batch, device=DEV, dtype=torch.int32), positions,
            comp.storage, 64, slots, comp_len)  # fmt: skip
    ref = sparse_decode_attention_reference(*args, torch.zeros(batch, 64, 512, device=DEV), 128, 64)
    got = sparse_decode_attention_triton(*args, torch.zeros(batch, 64, 512, device=DEV), 128, 64)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    seq_slot = args[4]
    for b in range(batch):  # each request alone: few requests' launch
        one = (qa[b : b + 1], sink, 512**-0.5, ring.storage, seq_slot[b : b + 1], positions[b : b + 1],
               comp.storage, 64, slots[b : b + 1], comp_len[b : b + 1])  # fmt: skip
        got = sparse_decode_attention_triton(*one, torch.zeros(1, 64, 512, device=DEV), 128, 64)
        torch.testing.assert_close(got, ref[b : b + 1], rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("batch", [8, 1])  # many requests' launches, and few requests'
def test_attention_on_a_gpu_with_99_kb_of_shared_memory(kv_dtype, batch, monkeypatch):
    """As Ada and consumer Blackwell GPUs run it: this GPU made to report their 99 KB a block, the launch picked is the
    one tests/engine/test_attention_shared_memory.py finds fitting there, and it gives the reference's result at flash
    sizes, eager and replayed in a CUDA graph."""
    monkeypatch.setattr(sparse_attention, "shared_memory_limit", lambda device: 101376)
    monkeypatch.setattr(sparse_attention, "_fitting", {})
    gen = torch.Generator(device=DEV).manual_seed(1)
    pages = 64
    ring, comp, q, sink = _attention_inputs(kv_dtype, batch, pages, gen)
    positions = torch.tensor([0, 5, 127, 128, 700, 4000, 9000, 60000], device=DEV, dtype=torch.int32)[-batch:]
    comp_len = (positions // 4).clamp(max=512)
    slots = torch.randint(0, pages * 64, (batch, 512), device=DEV, generator=gen).int()
    args = (q, sink, 512**-0.5, ring.storage, torch.arange(batch, device=DEV, dtype=torch.int32), positions,
            comp.storage, 64, slots, comp_len)  # fmt: skip
    ref = sparse_decode_attention_reference(*args, torch.zeros(batch, 64, 512, device=DEV), 128, 64)
    out = torch.zeros(batch, 64, 512, device=DEV)
    sparse_decode_attention_triton(*args, out, 128, 64)
    fp8, few = kv_dtype == "fp8_e4m3", batch <= sparse_attention.FEW_REQUESTS
    fits = LAUNCHES[fp8, few][0 if few and not fp8 else -1]  # few requests' bf16 launch fits 99 KB as it is
    assert list(sparse_attention._fitting.values()) == [fits]
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    out.zero_()
    graph, _ = capture(lambda: sparse_decode_attention_triton(*args, out, 128, 64))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("batch", [16, 64, 900, 2048])
def test_topk_writes_all_k_for_every_request_past_k(batch):
    """Every request past k rows gets k slots, the reference's set (random logits have no ties), over many calls: the
    radix select's clearing of its histogram once raced across warps, and a 900-query prefill block on the H200 then
    got selections short of k (uninitialised slots, an illegal address in attention)."""
    gen = torch.Generator(device=DEV).manual_seed(batch)
    pages = 12
    table = torch.randperm(pages + 4, device=DEV, generator=gen)[:pages].int()[None].expand(batch, -1)
    for _ in range(20):
        c4_len = torch.randint(513, pages * 64 + 1, (batch,), device=DEV, generator=gen, dtype=torch.int32)
        logits = torch.randn(batch, pages * 64, device=DEV, generator=gen)
        got = topk_slots_triton(logits, c4_len, table, 512, torch.full((batch, 512), -7, dtype=torch.int32, device=DEV))
        want = topk_slots_reference(logits, c4_len, table, 512, torch.empty(batch, 512, dtype=torch.int32, device=DEV))
        assert int((got < 0).sum()) == 0
        assert torch.equal(got.sort(dim=1).values, want.sort(dim=1).values)


@pytest.mark.parametrize(("ratio", "for_indexer", "dim"), [(4, False, 512), (4, True, 128), (128, False, 512)])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_compressor_decode_step_at_flash_sizes(ratio, for_indexer, dim, kv_dtype):
    gen = torch.Generator(device=DEV).manual_seed(1)
    batch, pages, coff = 8, 16, (2 if ratio == 4 else 1)
    ape = torch.randn(ratio, coff * dim, device=DEV, generator=gen)
    norm = torch.rand(dim, device=DEV, generator=gen) + 0.5
    inv_freq = rope_inv_freq(64, 160000.0, None).to(DEV)
    seq_slot = torch.arange(batch, device=DEV, dtype=torch.int32)
    table = torch.stack([torch.randperm(pages, device=DEV, generator=gen) for _ in range(batch)]).int()
    start = torch.randint(0, 3 * ratio, (batch,), device=DEV, generator=gen)

    def run(step_fn):
        out = IndexKeys(pages, dim, kv_dtype, DEV) if for_indexer else MainRows(pages, 256 // ratio, dim, 64,
                                                                                kv_dtype, DEV)  # fmt: skip
        kv_state = torch.zeros(batch, coff * ratio, coff * dim, device=DEV)
        score_state = torch.full((batch, coff * ratio, coff * dim), float("-inf"), device=DEV)
        steps = torch.Generator(device=DEV).manual_seed(2)
        for step in range(ratio + 2):
            kv = torch.randn(batch, coff * dim, device=DEV, generator=steps)
            score = torch.randn(batch, coff * dim, device=DEV, generator=steps)
            step_fn(kv, score, ape, norm, 1e-6, inv_freq, kv_state, score_state, seq_slot, (start + step).int(),
                    table, out.storage, out.rows_per_page, ratio, for_indexer, True)  # fmt: skip
        return out.read(torch.arange(pages * out.rows_per_page, device=DEV))

    ref, got = run(compressor_decode_step_reference), run(compressor_decode_step_triton)
    differ = (ref - got).abs() > 1e-3 * ref.abs().amax()
    assert differ.float().mean() < 1e-3  # only rounding flips from summing in another order


@pytest.mark.parametrize(("ratio", "for_indexer", "dim"), [(4, False, 512), (4, True, 128), (128, False, 512)])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_compress_chunk_at_flash_sizes(ratio, for_indexer, dim, kv_dtype):
    """A bf16 model's prefill chunks (one closing no window, one ending a window the state began, a long one, one
    token) through the kernels and the reference: the state exactly, the rows up to rounding flips."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    pages, coff = 64, (2 if ratio == 4 else 1)
    ape = torch.randn(ratio, coff * dim, device=DEV, generator=gen)
    norm = torch.rand(dim, device=DEV, generator=gen) + 0.5
    inv_freq = rope_inv_freq(64, 160000.0, None).to(DEV)
    table = torch.randperm(pages, device=DEV, generator=gen)
    chunks = [ratio - 1, 3, 2048 + ratio // 2, 1]

    def run(chunk_fn):
        out = IndexKeys(pages, dim, kv_dtype, DEV) if for_indexer else MainRows(pages, 256 // ratio, dim, 64,
                                                                                kv_dtype, DEV)  # fmt: skip
        kv_state = torch.zeros(coff * ratio, coff * dim, device=DEV)
        score_state = torch.full((coff * ratio, coff * dim), float("-inf"), device=DEV)
        inputs, first, states = torch.Generator(device=DEV).manual_seed(4), 0, []
        for length in chunks:
            kv = torch.randn(length, coff * dim, device=DEV, generator=inputs)
            score = torch.randn(length, coff * dim, device=DEV, generator=inputs)
            rows = torch.arange(first // ratio, (first + length) // ratio, device=DEV)
            slots = table[rows // out.rows_per_page] * out.rows_per_page + rows % out.rows_per_page
            chunk_fn(kv, score, torch.arange(first, first + length, device=DEV), first, kv_state, score_state, ape,
                     norm, 1e-6, inv_freq, out.storage, slots, out.rows_per_page, ratio, for_indexer, True,
                     torch.bfloat16)  # fmt: skip
            first += length
            states.append((kv_state.clone(), score_state.clone()))
        return out.read(torch.arange(pages * out.rows_per_page, device=DEV)), states

    (ref, ref_states), (got, got_states) = run(compress_chunk_reference), run(compress_chunk_triton)
    for (ref_kv, ref_score), (got_kv, got_score) in zip(ref_states, got_states, strict=True):
        assert torch.equal(got_kv, ref_kv) and torch.equal(got_score, ref_score)
    differ = (ref - got).abs() > 1e-2 * ref.abs().amax()
    assert differ.float().mean() < 1e-3  # only rounding flips from summing in another order


@pytest.mark.parametrize("rows", [65, 1500, 4095])
def test_a_plain_linear_at_its_gemm_row_count_gives_each_row_its_product(rows):
    """Unquantized linears pad a prefill's rows to gemm_rows (dispatch.py) with zero rows, whose outputs are
    dropped."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = Unquantized().linear({"weight": w}, x)
    assert out.shape == (rows, 4096) and out.is_contiguous()
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-2, atol=1e-1)
    groups = torch.randn(8 * 256, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    xg = torch.randn(rows, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    expected = torch.einsum("ngd,grd->ngr", xg, groups.view(8, 256, 128))
    torch.testing.assert_close(Unquantized().grouped_linear({"weight": groups}, xg), expected, rtol=1e-2, atol=1e-1)
    # Backward (the demo model's training): the padding rows add nothing to the weight's gradient.
    x32, w32 = x.float().requires_grad_(), w.float().requires_grad_()
    Unquantized().linear({"weight": w32}, x32).square().sum().backward()
    padded_grad = w32.grad.clone()
    w32.grad = None
    torch.nn.functional.linear(x32, w32).square().sum().backward()
    torch.testing.assert_close(padded_grad, w32.grad, rtol=1e-4, atol=1e-2)
