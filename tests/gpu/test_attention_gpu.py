"""The attention layer's decode path on a GPU at V4-Flash sizes (hidden 4096, q LoRA 1024, 64 heads x 512 with 64
RoPE channels, index 64 heads x 128, window 128): the fused window-row write and the compressed-row lists bit for
bit against what they replace, the fused projections against the separate GEMMs, one layer of each kind captured in
a CUDA graph against eager steps, and the kernels one layer launches per decode step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cache.block_manager import BlockManager, PageTable
from engine.cache.kv_cache import LayerKV, MainRows
from engine.kernels.kv_rows import (
    decode_row_lists_reference,
    decode_row_lists_triton,
    write_main_rows_triton,
    write_window_rows_reference,
    write_window_rows_triton,
)
from engine.kernels.norm import rms_norm_triton
from engine.kernels.quant import index_queries_reference, index_queries_triton, simulate_index_fp4_triton
from engine.kernels.rope import rope_triton
from engine.model.attention import Attention
from engine.model.layers import rope_inv_freq
from engine.model.state import ForwardBatch, SequenceState
from tests.gpu.flash_layers import ARGS, flash_attention

pytestmark = pytest.mark.gpu
DEV = "cuda"
HEAD_DIM, ROPE, WINDOW = ARGS.head_dim, ARGS.qk_rope_head_dim, ARGS.sliding_window


def _window_case(batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, 1024 + HEAD_DIM + 64, generator=gen) * 10.0 ** torch.randint(-3, 4, (batch, 1))
    x = wide.bfloat16().to(DEV)[:, 1024 : 1024 + HEAD_DIM]  # the wkv columns of the fused projection's output
    weight = (torch.rand(HEAD_DIM, generator=gen) + 0.5).to(DEV)
    positions = torch.randint(0, 1 << 20, (batch,), generator=gen).int().to(DEV)
    seq_slot = torch.randperm(batch, generator=gen).int().to(DEV)
    return x, weight, positions, seq_slot


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_window_row_write_is_norm_rope_and_row_write(batch):
    """The fused kernel stores the bytes the three kernels it replaces stored, and the reference's."""
    x, weight, positions, seq_slot = _window_case(batch, batch)
    inv_freq = rope_inv_freq(ROPE, 160000.0, None).to(DEV)
    ring = MainRows(batch, WINDOW, HEAD_DIM, ROPE, "fp8_e4m3", DEV)
    ring.storage.random_(0, 256, generator=torch.Generator(DEV).manual_seed(1))
    chain, fused, ref = ring.storage.clone(), ring.storage.clone(), ring.storage.clone()
    kv = rope_triton(rms_norm_triton(x, weight, 1e-6), positions, inv_freq)
    write_main_rows_triton(chain, seq_slot.long() * WINDOW + positions.long() % WINDOW, kv, WINDOW, ROPE)
    write_window_rows_triton(x, weight, 1e-6, positions, inv_freq, fused, seq_slot, WINDOW, True)
    write_window_rows_reference(x, weight, 1e-6, positions, inv_freq, ref, seq_slot, WINDOW, True)
    assert torch.equal(fused, chain)
    assert (fused != ref).sum() <= batch * 2  # torch's fp32 sum may differ in the last bit: a byte here and there


@pytest.mark.parametrize("batch", [1, 16, 64])
def test_index_queries_are_rope_then_fp4(batch):
    """One launch for what the rope kernel, the FP4 kernel and two torch ops gave, bit for bit."""
    heads, dim = ARGS.index_n_heads, ARGS.index_head_dim
    gen = torch.Generator().manual_seed(batch)
    wide = (torch.randn(batch, 32768 + heads * dim, generator=gen) * 3).bfloat16().to(DEV)
    q = wide[:, 32768:]  # the indexer's wq_b columns of the fused q GEMM
    weights = (torch.randn(batch, 1024 + 512 + heads, generator=gen)).bfloat16().to(DEV)[:, 1536:]
    positions = torch.randint(0, 1 << 20, (batch,), generator=gen).to(DEV)
    inv_freq = rope_inv_freq(ROPE, 160000.0, None).to(DEV)
    got_q, got_w = index_queries_triton(q, heads, positions, inv_freq, weights, 0.01, True)
    before = simulate_index_fp4_triton(rope_triton(q.reshape(batch, heads, dim), positions, inv_freq))
    assert torch.equal(got_q, before) and torch.equal(got_w, weights.float() * 0.01)
    ref_q, _ = index_queries_reference(q, heads, positions, inv_freq, weights, 0.01, True)
    assert (got_q != ref_q).float().mean() < 1e-3  # torch's cos / sin may differ from the GPU's in a last bit


@pytest.mark.parametrize(("ratio", "rows_per_page", "limit"), [(0, 128, 0), (4, 64, 512), (128, 2, 2**31 - 1)])
def test_decode_row_lists_at_a_million_tokens(ratio, rows_per_page, limit):
    gen = torch.Generator().manual_seed(ratio)
    batch, width = 16, 4096  # page tables for 1M tokens
    positions = torch.cat([torch.tensor([0, 3, 127, 128]), torch.randint(0, width * 256, (batch - 4,), generator=gen)])
    positions, table = positions.int().to(DEV), torch.randint(0, 1 << 16, (batch, width), generator=gen).int().to(DEV)
    ref = decode_row_lists_reference(positions, table, ratio, rows_per_page, limit, ratio > 4)
    got = decode_row_lists_triton(positions, table, ratio, rows_per_page, limit, ratio > 4)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    if ratio > 4:
        for b, n in enumerate(ref[1].tolist()):
            assert torch.equal(got[2][b, :n], ref[2][b, :n])


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_merged_projections_against_separate_gemms(ratio):
    """Each member of a merged projection gives what its own GEMM gives, at every decode batch size."""
    attn = flash_attention(ratio)
    groups = {"x": attn.x_proj, "qr": attn.qr_proj, "x_fp32": attn.x_fp32_proj}
    for batch in (1, 16, 64):
        x = torch.randn(batch, ARGS.hidden_size, device=DEV).bfloat16()
        inputs = {"x": x, "qr": torch.randn(batch, ARGS.q_lora_rank, device=DEV).bfloat16(), "x_fp32": x}
        for name, group in groups.items():
            if group is None:
                continue
            for part in group.parts:
                weights = [entry.stored()["weight"] for entry in part.weight_entries()]
                for got, member, weight in zip(part.split(inputs[name]), part.names, weights, strict=True):
                    # the compressors' members: bf16 weights, fp32 products
                    want = F.linear(x.float(), weight.float()) if name == "x_fp32" else F.linear(inputs[name], weight)
                    print(
                        f"ratio {ratio} batch {batch} {member} {tuple(weight.shape)}: bitwise equal "
                        f"{torch.equal(got, want)}, max diff {(got.float() - want.float()).abs().max().item():.3g}"
                    )
                    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


def _decode_setup(attn: Attention, batch: int, context: int):
    pool = BlockManager(batch * (context // 256 + 2) + 1, 256, batch)
    attn.kv = LayerKV(attn.ratio, pool.num_pages, batch + 1, ARGS, 256, "fp8_e4m3", DEV)
    for tensor in (attn.kv.ring.storage, *(t.storage for t in (attn.kv.comp, attn.kv.index) if t is not None)):
        tensor.random_(0, 120)  # e4m3 codes below 120 and small exponents: finite rows
    states, tables = [], []
    for slot in range(batch):
        table = PageTable()
        table.grow(pool, context + 257)  # room for later positions of the same test
        attn.kv.reset_slot(slot)
        states.append(SequenceState(slot=slot, num_tokens=context))
        tables.append(table)
    positions = torch.full((batch,), context, device=DEV)
    batch_ = ForwardBatch(torch.zeros(batch, dtype=torch.long, device=DEV), positions, states, [1] * batch)
    width = max(len(t.pages) for t in tables)
    page_table = torch.tensor([t.pages[:width] for t in tables], dtype=torch.int32, device=DEV)
    batch_.set_tables(page_table, torch.arange(batch, dtype=torch.int32, device=DEV))
    return batch_


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_one_layer_in_a_cuda_graph_gives_the_eager_step(ratio):
    """Capture-safe: the compressed-row lists the first layer of a kind makes a step are made inside the capture
    (the warm-up made them too, from the same batch object), and a replay at other positions gives the eager step."""
    attn, batch_size = flash_attention(ratio), 4
    batch = _decode_setup(attn, batch_size, 4095)  # at 4095, 4103 c4 windows close, at 4095, 4223 c128 ones
    x = torch.randn(batch_size, ARGS.hidden_size, device=DEV).bfloat16()
    kv = attn.kv
    tensors = lambda: [kv.ring.storage, *(t.storage for t in (kv.comp, kv.index) if t is not None),  # noqa: E731
                       *(kv.comp_state or ()), *(kv.index_state or ())]  # fmt: skip
    with torch.inference_mode():
        saved = [t.clone() for t in tensors()]
        attn(x, batch)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = attn(x, batch)
        for position in (4095, 4100, 4103 if ratio == 4 else 4223):  # within the pages grown
            for t, s in zip(tensors(), saved, strict=True):
                t.copy_(s)
            batch.positions.fill_(position)
            batch.positions_i32.fill_(position)
            graph.replay()
            replayed = out.clone()
            for t, s in zip(tensors(), saved, strict=True):
                t.copy_(s)
            eager = attn(x, batch)
            assert torch.equal(replayed, eager), (ratio, position)


# Kernels one layer launches per batch-1 decode step (the interpreter's count, tests/engine/test_attention_decode.py,
# plus what cuBLAS adds); before the fusions the interpreter counted 19, 80 and 35.
@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_kernels_per_decode_step(ratio):
    attn = flash_attention(ratio)
    batch = _decode_setup(attn, 1, 4095)
    x = torch.randn(1, ARGS.hidden_size, device=DEV).bfloat16()
    with torch.inference_mode():
        attn(x, batch)
        attn(x, batch)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            attn(x, batch)  # the first layer of its kind: the row lists too
            torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) <= {0: 11, 4: 30, 128: 14}[ratio] + 4, names  # up to 4 GEMMs a split-K reduction each
