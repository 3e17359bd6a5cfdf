"""The Triton kernels against their references on a real GPU at V4-Flash sizes (64 heads, head dim 512, indexer
64 x 128, top-k 512), bf16 and FP8 rows."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import IndexKeys, MainRows
from engine.kernels.indexer import indexer_logits_reference, indexer_logits_triton
from engine.kernels.quant import fp4_simulate
from engine.kernels.sparse_attention import sparse_decode_attention_reference, sparse_decode_attention_triton
from engine.kernels.topk import topk_slots_reference, topk_slots_triton

pytestmark = pytest.mark.gpu
DEV = "cuda"


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
    ring = MainRows(batch, 128, 512, 64, kv_dtype, DEV)
    ring.write(torch.arange(batch * 128, device=DEV), torch.randn(batch * 128, 512, device=DEV, generator=gen))
    comp = MainRows(pages, 64, 512, 64, kv_dtype, DEV)
    comp.write(torch.arange(pages * 64, device=DEV), torch.randn(pages * 64, 512, device=DEV, generator=gen))
    qa = torch.randn(batch, 64, 512, device=DEV, generator=gen).bfloat16()
    sink = torch.randn(64, device=DEV, generator=gen)
    positions = (c4_len * 4 + 3).int()
    comp_len = c4_len.clamp(max=512)
    args = (qa, sink, 512**-0.5, ring.storage, torch.arange(batch, device=DEV, dtype=torch.int32), positions,
            comp.storage, 64, slots, comp_len)  # fmt: skip
    ref = sparse_decode_attention_reference(*args, torch.zeros(batch, 64, 512, device=DEV), 128, 64)
    got = sparse_decode_attention_triton(*args, torch.zeros(batch, 64, 512, device=DEV), 128, 64)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
