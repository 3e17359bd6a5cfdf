"""Prefill attention through the decode kernels on a GPU at V4-Flash widths (64 heads x 512 with 64 RoPE channels,
index 64 heads x 128, top-k 512, window 128), FP8 rows with quant_sim, one layer of each kind with dummy weights:
against the torch prefill over a few thousand tokens in chunks, and the time of a 32K-token prefill in chunks of
4096 (printed, with an estimate for 128K; run with -s to see it)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import pytest
import torch
import triton

from engine.boot import kernel_variant, warm_up_chunks
from engine.cache.block_manager import BlockManager, PageTable
from engine.cache.kv_cache import LayerKV
from engine.model import attention
from engine.model.attention import Attention
from engine.model.state import ForwardBatch, SequenceState
from tests.gpu.flash_layers import ARGS, flash_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"


@dataclass
class _Request(SequenceState):
    """A request as these tests drive it: its model state and the pages it holds (the scheduler's, when serving)."""

    table: PageTable = field(default_factory=PageTable)


def _layer(ratio: int, tokens: int, requests: int) -> tuple[Attention, BlockManager]:
    """One attention layer of the kind, as the dummy load format makes it (bf16, fp32 where the reference keeps
    fp32), with an FP8 cache for `requests` requests of up to `tokens` tokens."""
    attn = flash_attention(ratio, DEV)
    pool = BlockManager(requests * (tokens // 256 + 1), 256, requests)
    attn.kv = LayerKV(ratio, pool.num_pages, requests, ARGS, 256, "fp8_e4m3", DEV)
    return attn, pool


def _request(attn: Attention, slot: int) -> _Request:
    attn.kv.reset_slot(slot)
    return _Request(slot=slot)


def _chunk(attn: Attention, pool: BlockManager, seq: _Request, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward over the request's next len(x) tokens, as the model runs a prefill chunk."""
    return _step(attn, pool, [(seq, x)])


def _step(attn: Attention, pool: BlockManager, chunks: list[tuple[_Request, torch.Tensor]]) -> torch.Tensor:
    """The layer's forward over one step of chunks, each request's next len(x) tokens, with the batch's page table
    as the runner makes it (a row per request, as wide as the longest)."""
    positions = []
    for seq, x in chunks:
        seq.table.grow(pool, seq.num_tokens + len(x))
        positions += range(seq.num_tokens, seq.num_tokens + len(x))
    lens, states = [len(x) for _, x in chunks], [seq for seq, _ in chunks]
    batch = ForwardBatch(torch.zeros(sum(lens), dtype=torch.long, device=DEV), torch.tensor(positions, device=DEV),
                         states, lens)  # fmt: skip
    tables = torch.zeros(len(states), max(len(seq.table.pages) for seq in states), dtype=torch.int32)
    for row, seq in zip(tables, states, strict=True):
        row[: len(seq.table.pages)] = torch.tensor(seq.table.pages)
    batch.set_tables(tables.to(DEV), torch.tensor([seq.slot for seq in states], dtype=torch.int32, device=DEV))
    with torch.inference_mode():
        out = attn(torch.cat([x for _, x in chunks]), batch)
    for seq, x in chunks:
        seq.num_tokens += len(x)
    return out


def _compare(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Per token, the relative error of the layer's output. The kernels' dots run in bf16 (the torch path in fp32)
    and a near-tie in the indexer's scores may pick another of the top-k rows: small errors on every token, and a
    few tokens whose swapped row weighs more (5.5e-2 at 28K context with the compressors' weights in bf16)."""
    rel = (got.float() - want.float()).norm(dim=-1) / want.float().norm(dim=-1)
    median, p99, worst = rel.median().item(), rel.quantile(0.99).item(), rel.max().item()
    print(f"{what}: relative error per token median {median:.2e}, p99 {p99:.2e}, max {worst:.2e}")
    assert median < 1e-2 and p99 < 3e-2 and worst < 1e-1, what


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_kernel_prefill_matches_the_torch_prefill(ratio, monkeypatch):
    """3000 tokens in chunks starting mid-page and mid-window (1000, 2100), past two c128 windows and the top-k."""
    cuts = [0, 1000, 2100, 3000]
    attn, pool = _layer(ratio, cuts[-1], 2)
    x = torch.randn(cuts[-1], ARGS.hidden_size, device=DEV, generator=torch.Generator(DEV).manual_seed(1)).bfloat16()
    kernel_seq, torch_seq = _request(attn, 0), _request(attn, 1)
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        got = _chunk(attn, pool, kernel_seq, x[a:b])
        with monkeypatch.context() as m:
            m.setattr(attention, "use_triton", lambda device: False)
            want = _chunk(attn, pool, torch_seq, x[a:b])
        _compare(got, want, f"ratio {ratio}, tokens {a}..{b}")


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_a_one_token_chunk_later_in_a_prompt_needs_no_new_kernel_variant(ratio):
    """After the runner's boot warm-up (its prompt in chunks of 1, 2, ..., 64, 127, 128, ... tokens), a step of two
    requests' chunks launches no new kernel variant: one's last token of a prompt cut at the budget (a one-query
    block; alone in a step it would be a decode row, replayed in the graphs) and the other's next two tokens, whose
    per-request slices (positions, projections) start mid-batch. Rows that every query of a block shares (page table,
    c128 and window lists) have stride 0 at any block size: with `expand`, one row kept its own stride, Triton
    specialised on it, and the H200 compiled 4 variants after boot for such chunks."""
    budget, room = 512, 2048
    attn, pool = _layer(ratio, room, 3)
    x = torch.randn(room, ARGS.hidden_size, device=DEV, generator=torch.Generator(DEV).manual_seed(3)).bfloat16()
    warm = _request(attn, 0)
    for n in warm_up_chunks(budget, room):
        if warm.num_tokens + n > room:  # the prompt starts over, as the runner's does
            warm.table.release(pool)
            warm = _request(attn, 0)
        _chunk(attn, pool, warm, x[warm.num_tokens : warm.num_tokens + n])
    later, other = _request(attn, 1), _request(attn, 2)
    _chunk(attn, pool, later, x[:300])  # a prompt's first part, cut at the step budget
    _chunk(attn, pool, other, x[:5])
    torch.cuda.synchronize()
    made, previous = [], triton.knobs.runtime.jit_post_compile_hook
    triton.knobs.runtime.jit_post_compile_hook = lambda *, fn, compile, **_: made.append(kernel_variant(fn, compile))
    try:
        _step(attn, pool, [(later, x[300:301]), (other, x[5:7])])
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_post_compile_hook = previous
    assert made == [], f"compiled after the warm-up: {made}"


def _cache_tensors(attn: Attention) -> list[torch.Tensor]:
    kv = attn.kv
    return [kv.ring.storage, *(t.storage for t in (kv.comp, kv.index) if t is not None), *(kv.comp_state or ()),
            *(kv.index_state or ())]  # fmt: skip


@pytest.mark.parametrize("ratio", [4, 128, 0])
def test_time_of_a_32k_prefill(ratio, monkeypatch):
    """32768 tokens in chunks of 4096 through one layer (projections, compressors, indexer, attention), each chunk
    timed; the time per chunk grows linearly with the context before it (the indexer scores every c4 row), so a
    line through them gives the 32 chunks of 128K. The last chunk also runs the torch prefill from the same cache,
    for the speed-up and a check at 28K context."""
    tokens, chunk = 32768, 4096
    attn, pool = _layer(ratio, tokens, 2)
    x = torch.randn(tokens, ARGS.hidden_size, device=DEV, generator=torch.Generator(DEV).manual_seed(2)).bfloat16()
    _chunk(attn, pool, _request(attn, 1), x[:chunk])  # compiles the kernels
    seq, starts, ms = _request(attn, 0), list(range(0, tokens, chunk)), []
    for start in starts:
        if start == starts[-1]:
            saved = [t.clone() for t in _cache_tensors(attn)]
        torch.cuda.synchronize()
        began = time.perf_counter()
        got = _chunk(attn, pool, seq, x[start : start + chunk])
        torch.cuda.synchronize()
        ms.append((time.perf_counter() - began) * 1e3)
    for t, s in zip(_cache_tensors(attn), saved, strict=True):
        t.copy_(s)
    seq.num_tokens = starts[-1]
    with monkeypatch.context() as m:
        m.setattr(attention, "use_triton", lambda device: False)
        torch.cuda.synchronize()
        began = time.perf_counter()
        want = _chunk(attn, pool, seq, x[starts[-1] :])
        torch.cuda.synchronize()
        torch_ms = (time.perf_counter() - began) * 1e3
    slope, base = statistics.linear_regression(starts, ms)
    long_starts = range(0, 131072, chunk)
    estimate = sum(base + slope * s for s in long_starts) / 1e3
    print(f"\nratio {ratio}: ms per {chunk}-token chunk at contexts {starts}: {[round(t, 1) for t in ms]}")
    print(f"ratio {ratio}: 32K prefill {sum(ms) / 1e3:.3f} s; estimated 128K ({len(long_starts)} chunks) "
          f"{estimate:.3f} s per layer of this kind; torch prefill of the last chunk {torch_ms:.1f} ms "
          f"(kernels {ms[-1]:.1f} ms)")  # fmt: skip
    _compare(got, want, f"ratio {ratio}, tokens {starts[-1]}..{tokens}")
