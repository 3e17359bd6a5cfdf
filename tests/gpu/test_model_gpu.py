"""The model on a GPU: its decode steps go through the Triton kernels (indexer, top-k, compressor step, sparse
attention) and must give what its prefill path gives."""

from __future__ import annotations

import pytest
import torch

from engine.cache.pool import PagePool
from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.tools.make_tiny import make_tiny

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")


CASES = [(torch.float32, "float32", False, 1e-3), (torch.bfloat16, "fp8_e4m3", True, None)]


@pytest.mark.parametrize(("dtype", "kv_dtype", "quant_sim", "tolerance"), CASES)
def test_kernel_decode_matches_prefill(tiny_dir, dtype, kv_dtype, quant_sim, tolerance):
    model = load_model(tiny_dir, dtype=dtype, device="cuda", quant_sim=quant_sim)
    model.allocate_kv_cache(PagePool(32, 256), 4, kv_dtype)
    ids = torch.randint(2, 1024, (300,), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        state = model.new_state()
        full = model.logits(model(ForwardBatch(ids, torch.arange(300, device="cuda"), [state], [300])))
        model.release_state(state)
        state, outs = model.new_state(), []
        outs.append(model.logits(model(ForwardBatch(ids[:250], torch.arange(250, device="cuda"), [state], [250]))))
        for i in range(250, 300):
            step = ForwardBatch(ids[i : i + 1], torch.tensor([i], device="cuda"), [state], [1])
            outs.append(model.logits(model(step)))
        model.release_state(state)
    decoded = torch.cat(outs)
    if tolerance is not None:
        assert (decoded - full).abs().max().item() <= tolerance
    else:
        # bf16 weights and FP8 rows round differently on the two paths, and on random weights a last-bit change moves
        # the indexer's top-8 now and then (the plain-torch decode path differs from prefill just as much). Seen on an
        # H200: mean cosine 0.9945, minimum 0.925, argmax agreement 0.86.
        cos = torch.nn.functional.cosine_similarity(decoded[250:], full[250:], dim=-1)
        assert cos.mean() > 0.99, cos
