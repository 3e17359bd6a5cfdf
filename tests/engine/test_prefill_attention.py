"""The attention layer's prefill path: each query's window rows and selected compressed rows, in blocks of queries
bounded by PREFILL_BUDGET, against the dense formula over every key with masks, for each layer kind; and the path
through the decode kernels (Triton's interpreter here), each query one batch row, against that torch path."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from engine.cache.kv_cache import LayerKV, MainRows
from engine.kernels import indexer, sparse_attention, topk
from engine.kernels.quant import simulate_kv_row_fp8
from engine.kernels.sparse_attention import sparse_decode_attention_reference, sparse_decode_attention_triton
from engine.model import attention
from engine.model.args import ModelArgs
from engine.model.attention import Attention
from engine.model.state import ForwardBatch, SequenceState
from engine.tools.make_tiny import TINY_CONFIG

TINY = ModelArgs.from_config(TINY_CONFIG)  # window 16; 8 heads x 128; indexer 16 heads x 128, top 8
PAGE = 256
# Chunks of one request: a single token, lengths off multiples of 4 and 128, starts mid-window and mid-compression
# window, a chunk longer than the window, a context past two c128 windows and past the top-k.
CUTS = [0, 1, 38, 39, 170, 261, 262, 301]


def _layer(
    args: ModelArgs, ratio: int, pages: int, kv_dtype: str = "float32"
) -> tuple[Attention, SequenceState, ForwardBatch]:
    gen = torch.Generator().manual_seed(ratio)
    attn = Attention(args, args.compress_ratios.index(ratio), quant_sim=kv_dtype == "fp8_e4m3")
    with torch.no_grad():  # what the path reads of the layer's parameters: sink, compressors' position biases
        for name, param in attn.named_parameters():
            if name.endswith(("attn_sink", "ape")):
                param.copy_(torch.randn(param.shape, generator=gen))
    attn.kv = LayerKV(ratio, pages, 1, args, PAGE, kv_dtype, "cpu")
    attn.kv.reset_slot(0)
    seq = SequenceState(slot=0)
    return attn, seq, _tables(seq, list(range(pages - 1, -1, -1)))


def _tables(seq: SequenceState, pages: list[int]) -> ForwardBatch:
    """A batch with the request's device-side tables (its slot, its row of page ids), as a step hands them over."""
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [seq], [1])
    batch.set_tables(torch.tensor([pages], dtype=torch.int32), torch.tensor([seq.slot], dtype=torch.int32))
    return batch


def _inputs(args: ModelArgs, ratio: int, length: int, seed: int = 0):
    """Random q [L, H, D], kv rows [L, D] and the projections the compressors and the indexer read."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, kv, proj = randn(length, args.num_attention_heads, args.head_dim), randn(length, args.head_dim), {}
    if ratio:
        width = (2 if ratio == 4 else 1) * args.head_dim
        proj["comp"] = (randn(length, width), randn(length, width))
    if ratio == 4:
        heads, dim = args.index_n_heads, args.index_head_dim
        proj["index"] = (randn(length, 2 * dim), randn(length, 2 * dim))
        proj["query"] = (randn(length, heads, dim), randn(length, heads))
    return q, kv, proj


def _dense(attn: Attention, q, kv, proj, positions, window_before, comp_rows, index_keys) -> torch.Tensor:
    """Every key the request has, masked per query: the window, then the top-k (c4) or visible (c128) rows."""
    keys = torch.cat([window_before, kv])
    key_pos = torch.arange(int(positions[0]) - len(window_before), int(positions[-1]) + 1)
    delta = positions[:, None] - key_pos[None, :]
    allowed = (delta >= 0) & (delta < attn.window)
    if attn.ratio:
        visible = torch.arange(len(comp_rows))[None, :] < ((positions + 1) // attn.ratio)[:, None]
        if attn.indexer is not None:
            iq, iw = proj["query"]
            scores = (torch.einsum("thd,nd->thn", iq, index_keys).relu() * iw[..., None]).sum(1)
            order = scores.masked_fill(~visible, float("-inf")).sort(dim=-1, descending=True, stable=True).indices
            visible &= torch.zeros_like(visible).scatter_(1, order[:, : attn.indexer.topk], True)
        keys, allowed = torch.cat([keys, comp_rows]), torch.cat([allowed, visible], dim=1)
    s = (torch.einsum("thd,ld->thl", q, keys) * attn.scale).masked_fill(~allowed[:, None, :], float("-inf"))
    s = torch.cat([s, attn.attn_sink.expand(len(q), -1)[..., None]], dim=-1)  # the sink: a logit with no value
    return torch.einsum("thl,ld->thd", s.softmax(dim=-1)[..., :-1], keys)


def _run_chunks(ratio: int, cuts: list[int], check_dense: bool) -> list[torch.Tensor]:
    attn, seq, tables = _layer(TINY, ratio, pages=2)
    q, kv, proj = _inputs(TINY, ratio, cuts[-1])
    cache, window, outs = attn.kv, attn.window, []
    with torch.no_grad():
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            positions = torch.arange(a, b)
            chunk = {k: (x[a:b], y[a:b]) for k, (x, y) in proj.items()}
            window_before = cache.ring.read(torch.arange(max(0, a - window + 1), a) % window)
            seq.num_tokens = a  # as a step's state has it: the row's first position
            outs.append(attn._prefill(q[a:b], kv[a:b], chunk, positions, seq, tables, 0))
            if not check_dense:
                continue
            n = b // ratio if ratio else 0
            comp_rows = cache.comp.read(tables.row_slots(0, 0, n, cache.comp.rows_per_page)) if ratio else None
            index_keys = cache.index.read(tables.row_slots(0, 0, n, 64)) if ratio == 4 else None
            want = _dense(attn, q[a:b], kv[a:b], chunk, positions, window_before, comp_rows, index_keys)
            torch.testing.assert_close(outs[-1], want, rtol=1e-5, atol=1e-5, msg=f"chunk {a}..{b}")
    return outs


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_prefill_chunks_match_the_dense_formula(ratio):
    _run_chunks(ratio, CUTS, check_dense=True)


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_a_tiny_budget_gives_the_same_results(ratio, monkeypatch):
    large = _run_chunks(ratio, CUTS, check_dense=False)
    monkeypatch.setattr(attention, "PREFILL_BUDGET", 64)  # one query a block, a few index rows a product
    small = _run_chunks(ratio, CUTS, check_dense=False)
    for got, want in zip(small, large, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_selection_keeps_the_lower_row_among_equal_scores(monkeypatch):
    attn, _, _ = _layer(TINY, 4, pages=1)
    gen = torch.Generator().manual_seed(1)
    heads, dim = TINY.index_n_heads, TINY.index_head_dim
    keys = torch.randn(40, dim, generator=gen)
    keys[torch.arange(40) % 7 != 5] = 0  # rows of score 0, tied: all but rows 5, 12, 19, 26, 33
    q, w = torch.randn(5, heads, dim, generator=gen), torch.rand(5, heads, generator=gen)
    positions = torch.tensor([2, 30, 77, 150, 159])  # 0, 7, 19, 37 and 40 visible rows
    want = attn.indexer.select(q, w, positions, keys)
    monkeypatch.setattr(attention, "PREFILL_BUDGET", 1)
    assert torch.equal(attn.indexer.select(q, w, positions, keys), want)
    scores = (torch.einsum("thd,nd->thn", q, keys).relu() * w[..., None]).sum(1)
    for t, visible in enumerate(((positions + 1) // 4).tolist()):
        order = sorted(range(visible), key=lambda j: (-scores[t, j].item(), j))[: TINY.index_topk]
        assert want[t].tolist() == order + [-1] * (len(want[t]) - len(order))
    assert want[2].tolist() == [5, 12, 0, 1, 2, 3, 4, 6]  # 19 visible: the two scored rows, then the lowest ties


class _LargestTensor(TorchDispatchMode):
    """The most elements any op's output holds in memory of its own (views and in-place results hold none)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, t.untyped_storage().nbytes() // t.element_size())
        return out


@pytest.mark.parametrize("ratio", [4, 128])
def test_a_long_chunk_at_a_long_context_stays_within_the_budget(ratio, monkeypatch):
    """2048 tokens after 22528: the dense path's c4 index scores alone would be [2048, heads, 6144]."""
    args = dataclasses.replace(TINY, num_attention_heads=4, head_dim=64, qk_rope_head_dim=32, index_n_heads=4,
                               index_head_dim=32, index_topk=64, sliding_window=32)  # fmt: skip
    budget, p0, length = 2**20, 22528, 2048
    monkeypatch.setattr(attention, "PREFILL_BUDGET", budget)
    attn, seq, tables = _layer(args, ratio, pages=(p0 + length) // PAGE)
    gen = torch.Generator().manual_seed(3)
    for rows in (attn.kv.ring, attn.kv.comp, attn.kv.index)[: 3 if ratio == 4 else 2]:  # the context before
        rows.storage.copy_(torch.randn(rows.storage.shape, generator=gen))
    q, kv, proj = _inputs(args, ratio, length)
    chunk_sized = q.numel()  # the output, as large as the queries; the largest tensor the chunk has anyway
    assert chunk_sized <= budget < length * args.index_n_heads * (p0 // 4)
    seq.num_tokens = p0
    with torch.no_grad(), _LargestTensor() as mode:
        out = attn._prefill(q, kv, proj, torch.arange(p0, p0 + length), seq, tables, 0)
    assert out.isfinite().all()
    assert mode.largest <= budget


# Chunks of one request; those in KERNEL_CHUNKS run through the kernels (few queries: the interpreter runs them
# program by program), the others fill the cache. Through the kernels: shorter than the window and than the top-k's
# c4 rows from 0, then from mid-window (p0 = 5); past the top-k with window rows from the ring; across the first c128
# window close (127); from 253, not page-aligned, across the second c128 close, a page boundary (256) and into the
# second page of c4 rows (259).
KERNEL_CUTS = [0, 5, 9, 40, 46, 126, 129, 253, 260]
KERNEL_CHUNKS = {0, 1, 3, 5, 7}


def _prefill_chunks(ratio: int, kv_dtype: str, dtype: torch.dtype, monkeypatch=None) -> list[torch.Tensor]:
    """The outputs of the request's chunks, from inputs in `dtype` as a model of that dtype makes them (FP8 rows
    come with quant_sim, whose kv the forward pass rounds as the FP8 ring stores it); with `monkeypatch`, the
    KERNEL_CHUNKS through the kernels."""
    attn, seq, tables = _layer(TINY, ratio, 2, kv_dtype)
    q, kv, proj = _inputs(TINY, ratio, KERNEL_CUTS[-1])
    q, kv = q.to(dtype), kv.to(dtype)
    if attn.quant_sim:
        kv = simulate_kv_row_fp8(kv, TINY.qk_rope_head_dim)
    if ratio == 4:
        proj["query"] = (proj["query"][0].to(dtype), proj["query"][1])
    outs = []
    for i, (a, b) in enumerate(zip(KERNEL_CUTS[:-1], KERNEL_CUTS[1:], strict=True)):
        chunk = {k: (x[a:b], y[a:b]) for k, (x, y) in proj.items()}
        with torch.no_grad(), contextlib.ExitStack() as stack:
            if monkeypatch is not None and i in KERNEL_CHUNKS:
                _through_the_kernels(stack.enter_context(monkeypatch.context()))
            seq.num_tokens = a
            outs.append(attn._prefill(q[a:b], kv[a:b], chunk, torch.arange(a, b), seq, tables, 0))
    return outs


def _through_the_kernels(monkeypatch) -> None:
    """The layer's prefill and the kernels it calls pick Triton; the cache's row writers keep their references, so
    both paths store the same rows (the interpreter rounds to e4m3 its own way, test_attention_decode.py). A tiny
    budget: c4 queries in blocks of a few, the last one partial."""
    for module in (attention, indexer, topk, sparse_attention):
        monkeypatch.setattr(module, "use_triton", lambda device: True)
    monkeypatch.setattr(attention, "PREFILL_BUDGET", 256)


@pytest.mark.parametrize("ratio", [0, 4, 128])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
def test_kernel_prefill_matches_the_torch_prefill(ratio, kv_dtype, monkeypatch):
    want = _prefill_chunks(ratio, kv_dtype, torch.bfloat16)
    got = _prefill_chunks(ratio, kv_dtype, torch.bfloat16, monkeypatch)
    for i in sorted(KERNEL_CHUNKS):
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-5, msg=f"chunk at {KERNEL_CUTS[i]}")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "fp8_e4m3"])
@pytest.mark.parametrize("splits", [1, 3])  # the prefill's (a program per query), split-K + combine
def test_attention_kernel_reads_window_rows_from_a_span(kv_dtype, splits):
    """Each query's window is the rows up to its own in a span of rows, pages of `window` rows, the top-k list
    beside it; positions from 0 (a partial window) to past the window, own rows across span pages."""
    gen = torch.Generator().manual_seed(8)
    heads, dim, rope, window, k = 8, 128, 64, 16, 5
    positions = torch.tensor([0, 3, 15, 16, 17, 40], dtype=torch.int32)
    own_row = positions - positions[0] + window - 1  # a chunk from position 0: window - 1 rows of padding first
    span = MainRows(4, window, dim, rope, kv_dtype, "cpu")
    span.write(torch.arange(4 * window), torch.randn(4 * window, dim, generator=gen))
    comp = MainRows(6, 64, dim, rope, kv_dtype, "cpu")
    comp.write(torch.arange(6 * 64), torch.randn(6 * 64, dim, generator=gen))
    slots = torch.randint(0, 6 * 64, (len(positions), k), generator=gen).int()
    comp_len = torch.tensor([0, 0, 3, 4, 5, 5], dtype=torch.int32)
    q = torch.randn(len(positions), heads, dim, generator=gen).to(torch.bfloat16)
    sink = torch.randn(heads, generator=gen)
    args = (q, sink, dim**-0.5, span.storage, own_row, positions, comp.storage, 64, slots, comp_len)
    ref = sparse_decode_attention_reference(*args, torch.zeros(len(positions), heads, dim), window, rope, True)
    got = sparse_decode_attention_triton(*args, torch.zeros(len(positions), heads, dim), window, rope, True,
                                         splits=splits)  # fmt: skip
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_the_torch_attention_with_sinks_has_the_gradients_of_its_formula():
    """The demo model trains through the torch prefill path: its attention gives the gradients of softmax over the
    keys and the sink (float64, per-query and shared key parts, masked keys)."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(5, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    window = torch.randn(5, 4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    shared = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(2, generator=gen, dtype=torch.float64, requires_grad=True)
    allowed = [torch.rand(5, 4, generator=gen) > 0.3, torch.rand(5, 3, generator=gen) > 0.3]
    allowed[0][:, 0] = True
    got = sparse_attention.attend_parts_with_sink(q, [(window, allowed[0]), (shared, allowed[1])], sink, 0.5)
    keys = torch.cat([window, shared.expand(5, 3, 8)], dim=1)
    s = torch.einsum("thd,tld->thl", q, keys) * 0.5
    s = s.masked_fill(~torch.cat(allowed, dim=1)[:, None, :], float("-inf"))
    p = torch.softmax(torch.cat([s, sink[None, :, None].expand(5, 2, 1)], dim=-1), dim=-1)[..., :-1]
    want = torch.einsum("thl,tld->thd", p, keys)
    torch.testing.assert_close(got, want)
    weights = torch.randn(got.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((got * weights).sum(), (q, window, shared, sink))
    expected = torch.autograd.grad((want * weights).sum(), (q, window, shared, sink))
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e)
