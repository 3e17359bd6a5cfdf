"""The plain-torch model against transformers' DeepseekV4ForCausalLM (5.23.0), and against itself across prefill,
chunked prefill, token-by-token decode and batching."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant import E2M1_VALUES
from engine.model.state import ForwardBatch
from tests.engine.conftest import load_with_cache, prefill_logits


@pytest.fixture(scope="module")
def hf_logits(tiny_dir, prompt_ids):
    transformers = pytest.importorskip("transformers")
    assert transformers.__version__ == "5.23.0", "the parity oracle is transformers 5.23.0"
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(prompt_ids[None]).logits[0]


def test_prefill_logits_match_transformers(fp32_model, prompt_ids, hf_logits):
    ours = prefill_logits(fp32_model, prompt_ids)
    assert ours.shape == hf_logits.shape == (330, 1024)
    assert (ours - hf_logits).abs().max().item() <= 1e-3
    # The indexer really selects: c4 layers see 82 rows at the end but attend to index_topk = 8 of them.
    assert len(prompt_ids) // 4 > 4 * fp32_model.args.index_topk


def test_quant_sim_is_the_official_behaviour_and_differs_from_transformers(fp32_model_quant_sim, prompt_ids, hf_logits):
    ours = prefill_logits(fp32_model_quant_sim, prompt_ids)
    # FP4 rounding of index queries/keys moves the top-8 selection, so the difference is not small on random weights.
    assert torch.isfinite(ours).all() and (ours - hf_logits).abs().max().item() > 1e-3
    model = fp32_model_quant_sim
    state = model.new_state()
    batch = ForwardBatch(prompt_ids, torch.arange(330), [state], [330])
    with torch.no_grad():
        model(batch)
    c4 = model.kv_cache.layers[2]  # what the cache holds for a c4 layer
    window = c4.ring.read(state.slot * 16 + torch.arange(16))
    index_rows = c4.index.read(batch.row_slots(0, 0, 330 // 4, 64))
    model.release_state(state)
    # KV rows: nope channels on the e4m3 grid of their 64-wide block's power-of-two scale.
    nope = window[:, :64]
    scale = torch.exp2(torch.ceil(torch.log2(nope.abs().amax(-1, keepdim=True) / 448)))
    assert torch.equal((nope / scale).to(torch.float8_e4m3fn).float() * scale, nope)
    # Indexer keys: FP4 (e2m1) values per 32-wide block after the Hadamard rotation.
    keys = index_rows.unflatten(-1, (-1, 32))
    scale = torch.exp2(torch.ceil(torch.log2(keys.abs().amax(-1, keepdim=True) / 6)))
    assert torch.isin((keys / scale).abs(), E2M1_VALUES).all()


def _incremental_logits(model, ids, cuts):
    state, outs = model.new_state(), []
    with torch.no_grad():
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            outs.append(model.logits(model(ForwardBatch(ids[a:b], torch.arange(a, b), [state], [b - a]))))
    model.release_state(state)
    return torch.cat(outs)


@pytest.mark.parametrize("quant_sim", [False, True])
def test_chunked_prefill_and_decode_give_the_prefill_logits(tiny_dir, fp32_model, prompt_ids, quant_sim):
    # With quant_sim the model rounds to coarse FP4/FP8 grids, where an fp32 difference in the last bit between a
    # chunked and a one-shot matmul can flip one rounding and, through the top-k, move later logits. float64 makes
    # such flips vanishingly rare, so the state bookkeeping itself is checked exactly.
    model = load_with_cache(tiny_dir, dtype=torch.float64, quant_sim=True) if quant_sim else fp32_model
    full = prefill_logits(model, prompt_ids)
    # Chunks that end mid-window, on and off c4 / c128 boundaries, then one token at a time across (pos+1)%128==0.
    cuts = [0, 37, 127, 128, 130, 200, *range(201, 331)]
    incremental = _incremental_logits(model, prompt_ids, cuts)
    assert (incremental - full).abs().max().item() <= 1e-4
    assert torch.equal(incremental.argmax(-1), full.argmax(-1))


def test_batched_requests_of_different_lengths_give_what_each_gives_alone(fp32_model, prompt_ids):
    a, b = prompt_ids[:330], prompt_ids[40:190]
    alone_a, alone_b = prefill_logits(fp32_model, a), prefill_logits(fp32_model, b)
    states = [fp32_model.new_state(), fp32_model.new_state()]
    with torch.no_grad():
        batch = ForwardBatch(torch.cat([a, b]), torch.cat([torch.arange(330), torch.arange(150)]), states, [330, 150])
        both = fp32_model.logits(fp32_model(batch))
    for state in states:
        fp32_model.release_state(state)
    assert (both[:330] - alone_a).abs().max().item() <= 1e-4
    assert (both[330:] - alone_b).abs().max().item() <= 1e-4


def test_greedy_decode_prefill_then_decode_equals_token_by_token(fp32_model_quant_sim, prompt_ids):
    model, prompt = fp32_model_quant_sim, prompt_ids[:300]

    def greedy(feed_prompt_at_once: bool) -> list[int]:
        state, out = model.new_state(), []
        with torch.no_grad():
            if feed_prompt_at_once:
                logits = model.logits(model(ForwardBatch(prompt, torch.arange(300), [state], [300])))[-1]
            else:
                for i in range(300):
                    logits = model.logits(model(ForwardBatch(prompt[i : i + 1], torch.tensor([i]), [state], [1])))[-1]
            for step in range(64):  # ignore_eos: the decode crosses (pos+1) % 4 == 0 and % 128 == 0 positions
                token = int(logits.argmax())
                out.append(token)
                pos = torch.tensor([300 + step])
                logits = model.logits(model(ForwardBatch(torch.tensor([token]), pos, [state], [1])))[-1]
        model.release_state(state)
        return out

    assert greedy(True) == greedy(False)


def test_mtp_layer_loads_and_its_incremental_run_matches_prefill(fp32_model, prompt_ids):
    model = fp32_model
    assert len(model.mtp) == 1
    ids, nxt = prompt_ids[:200], prompt_ids[1:201]
    state = model.new_state()
    with torch.no_grad():
        batch = ForwardBatch(ids, torch.arange(200), [state], [200])
        full = model.mtp_logits(model(batch), nxt, batch)
        model.release_state(state)
        state, outs = model.new_state(), []
        for a, b in [(0, 130), *[(i, i + 1) for i in range(130, 200)]]:
            step = ForwardBatch(ids[a:b], torch.arange(a, b), [state], [b - a])
            outs.append(model.mtp_logits(model(step), nxt[a:b], step))
    model.release_state(state)
    assert full.shape == (200, 1024) and torch.isfinite(full).all()
    assert (torch.cat(outs) - full).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_decode_through_the_triton_kernels_gives_the_prefill_logits(fp32_model, prompt_ids, monkeypatch):
    """The decode path's Triton kernels (interpreted on the CPU) inside the model: indexer, top-k, compressor step,
    sparse attention. Decoding across c4 boundaries and the (pos+1) % 128 == 0 position gives the prefill logits."""
    model, ids = fp32_model, prompt_ids[:262]
    full = prefill_logits(model, ids)
    state, outs = model.new_state(), []
    with torch.no_grad():
        outs.append(model.logits(model(ForwardBatch(ids[:250], torch.arange(250), [state], [250]))))
        # Only the decode steps through the kernels: the interpreter runs a 250-token chunk's MoE and mHC kernels
        # program by program (minutes); their prefill shapes have tests of their own.
        monkeypatch.setenv("FLASHGATE_KERNELS", "triton")
        for i in range(250, 262):
            outs.append(model.logits(model(ForwardBatch(ids[i : i + 1], torch.tensor([i]), [state], [1]))))
    model.release_state(state)
    assert (torch.cat(outs) - full).abs().max().item() <= 1e-4
