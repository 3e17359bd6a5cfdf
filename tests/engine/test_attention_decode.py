"""The attention layer's decode path: its fused kernels (window-row write, compressed-row lists) against their
plain-torch references in Triton's interpreter, the fused projections, the per-step values the layers share, and
the launches one layer of each kind makes per decode step."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime import interpreter

from engine.cache.kv_cache import MainRows
from engine.kernels.kv_rows import (
    decode_row_lists_reference,
    decode_row_lists_triton,
    write_window_rows_reference,
    write_window_rows_triton,
)
from engine.kernels.norm import rms_norm_reference, rms_norm_triton
from engine.kernels.quant import index_queries_reference, index_queries_triton
from engine.kernels.rope import rms_rope_triton, rope_triton
from engine.model.layers import rope_inv_freq
from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.standalone import Standalone

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

DIM, ROPE, WINDOW, SLOTS = 256, 64, 16, 4
INV_FREQ = rope_inv_freq(ROPE, 10000.0, None)


def _window_inputs(gen: torch.Generator, dtype: torch.dtype):
    """Projections [5, DIM] as a column slice of a wider product (strided rows), one with an all-zero norm block."""
    wide = torch.randn(5, DIM + 96, generator=gen) * torch.logspace(-3, 3, 5)[:, None]
    x = wide.to(dtype)[:, 32 : 32 + DIM]
    weight = torch.rand(DIM, generator=gen) + 0.5
    weight[64:128] = 0  # a whole scale block of zeros after the norm
    positions = torch.tensor([0, 15, 16, 200, 7], dtype=torch.int32)  # ring rows 0, 15, 0, 8, 7
    seq_slot = torch.tensor([3, 0, 1, 2, 0], dtype=torch.int32)[[0, 1, 2, 3, 1]]
    seq_slot[4] = 2
    return x, weight, positions, seq_slot


@pytest.mark.parametrize(("kv_dtype", "quant_sim"), [("float32", False), ("float32", True), ("fp8_e4m3", True)])
def test_window_row_write_matches_the_reference(kv_dtype, quant_sim):
    x, weight, positions, seq_slot = _window_inputs(torch.Generator().manual_seed(0), torch.float32)
    rings = {}
    for name, impl in (("ref", write_window_rows_reference), ("triton", write_window_rows_triton)):
        ring = MainRows(SLOTS, WINDOW, DIM, ROPE, kv_dtype, "cpu")
        ring.storage.copy_(torch.randint(0, 100, ring.storage.shape, generator=torch.Generator().manual_seed(1)))
        impl(x, weight, 1e-6, positions, INV_FREQ, ring.storage, seq_slot, WINDOW, quant_sim)
        rings[name] = ring
    written = (seq_slot.long() * WINDOW + positions.long() % WINDOW).tolist()
    untouched = torch.tensor([s not in written for s in range(SLOTS * WINDOW)])
    ref, got = (rings[k].read(torch.arange(SLOTS * WINDOW)) for k in ("ref", "triton"))
    assert torch.equal(got[untouched], ref[untouched]), "rows the step does not write stay as they were"
    if kv_dtype == "float32" and not quant_sim:
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        return
    # fp32 sums in another order can move a value across an e4m3 rounding boundary (and the interpreter converts to
    # e4m3 its own way); tests/gpu/test_attention_gpu.py checks the bytes exactly.
    rope_tol = 2**-7 if kv_dtype == "fp8_e4m3" else 1e-5  # FP8 rows keep RoPE channels in bf16
    torch.testing.assert_close(got[:, -ROPE:], ref[:, -ROPE:], rtol=rope_tol, atol=1e-6)
    assert ((got - ref).abs() > 1e-6 * ref.abs().amax()).float().mean() < 0.02
    assert ref[written][:, 64:128].abs().max() == 0 and got[written][:, 64:128].abs().max() == 0


@pytest.mark.parametrize(("ratio", "rows_per_page", "limit", "with_slots"),
                         [(0, 16, 0, False), (4, 64, 8, False), (128, 2, 2**31 - 1, True)])  # fmt: skip
def test_decode_row_lists_match_the_reference(ratio, rows_per_page, limit, with_slots):
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 3, 127, 128, 1000, 4095], dtype=torch.int32)
    table = torch.stack([torch.randperm(40, generator=gen)[:16] for _ in range(len(positions))]).int()
    ref = decode_row_lists_reference(positions, table, ratio, rows_per_page, limit, with_slots)
    got = decode_row_lists_triton(positions, table, ratio, rows_per_page, limit, with_slots)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert got[0].dtype == got[1].dtype == got[2].dtype == torch.int32 and got[2].shape == ref[2].shape
    for b, n in enumerate(ref[1].tolist()):
        assert torch.equal(got[2][b, :n], ref[2][b, :n]) if with_slots else n <= limit


def test_per_step_values_are_made_once_a_step():
    batch = ForwardBatch(torch.zeros(2), torch.zeros(2), [], [1, 1])
    made = []

    def make():
        made.append(len(made))
        return made[-1]

    assert [batch.per_step("k", layer, make) for layer in (0, 3, 5)] == [0, 0, 0]  # one step: layer 0 makes it
    # The same batch again (a graph's warm-up, then its capture): the layer that made it makes it anew.
    assert [batch.per_step("k", layer, make) for layer in (0, 3, 5)] == [1, 1, 1]
    assert batch.per_step("other", 3, make) == 2


@pytest.fixture(scope="module")
def tiny_bf16(tiny_dir):
    return load_model(tiny_dir, dtype=torch.bfloat16, quant_sim=True)


class _Launches(TorchDispatchMode):
    """Kernels a GPU would launch: torch ops that compute (not views or allocations), and Triton kernels."""

    FREE = {"view", "_unsafe_view", "slice", "select", "expand", "as_strided", "t", "transpose", "permute", "unsqueeze",
            "squeeze", "alias", "detach", "empty", "empty_like", "empty_strided", "split", "split_with_sizes",
            "unbind", "lift_fresh", "scalar_tensor", "_reshape_alias"}  # fmt: skip

    def __init__(self):
        super().__init__()
        self.ops, self.inside_triton = collections.Counter(), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside_triton and name not in self.FREE:
            self.ops[f"aten.{name}"] += 1
        return func(*args, **(kwargs or {}))


def decode_launches(model, monkeypatch) -> dict[int, list[collections.Counter]]:
    """Launches of each layer's Attention.forward in the second of two batch-1 decode steps (the first makes what a
    server makes once), per compress ratio, in layer order."""
    counting: list[_Launches] = []
    run = interpreter.InterpretedFunction.run

    def counted_run(self, *args, **kwargs):
        if counting:
            counting[0].ops[f"triton.{self.fn.__name__}"] += 1
            counting[0].inside_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            if counting:
                counting[0].inside_triton -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted_run)
    monkeypatch.setenv("FLASHGATE_KERNELS", "triton")
    state = model.new_state()
    state.num_tokens = 39  # the rows' contents do not change the step's launches; 10 c4 rows > index_topk 8
    batch = ForwardBatch(torch.tensor([5]), torch.tensor([39]), [state], [1])
    model.prepare(batch)
    x = torch.randn(1, model.args.hidden_size, generator=torch.Generator().manual_seed(0)).to(model.dtype)
    launches: dict[int, list[collections.Counter]] = collections.defaultdict(list)
    try:
        with torch.no_grad():
            for step in range(2):
                for layer in model.layers:
                    counting.append(_Launches())
                    with counting[0]:
                        layer.attn(x, batch)
                    if step:
                        launches[layer.attn.ratio].append(counting[0].ops)
                    counting.clear()
    finally:
        model.release_state(state)
    return launches


# Launches per layer at batch 1: window-only, c4 (with the indexer), c128; was 19, 80, 35. The first layer of each
# kind makes the kind's compressed-row lists for the whole step (one launch more). Counted on the CPU, where the
# compressors' bf16 weights are cast for their fp32 product (one op more than CUDA's mm with an fp32 output).
LAUNCH_BUDGET = {0: 10, 4: 30, 128: 14}


def test_decode_launches_per_layer_kind(tiny_bf16, monkeypatch):
    model = tiny_bf16
    launches = decode_launches(Standalone.allocate(model, 8, 2, "fp8_e4m3"), monkeypatch)
    for ratio, budget in LAUNCH_BUDGET.items():
        first, *others = (sum(ops.values()) for ops in launches[ratio])
        assert first <= budget + 1 and all(n == first - 1 for n in others), (ratio, launches[ratio])
        assert launches[ratio][0]["triton._decode_row_lists_kernel"] == 1
        assert launches[ratio][-1]["aten.mm"] == (4 if ratio else 3)


@pytest.mark.parametrize("quant_sim", [False, True])
def test_index_queries_match_the_reference(quant_sim):
    """RoPE, Hadamard + FP4 of the index queries and the head weights' scaling in one launch, from column slices of
    the fused projections. fp32: the interpreter's bf16 conversion is its own (tests/engine/test_fused_rows.py)."""
    gen = torch.Generator().manual_seed(5)
    tokens, heads, dim = 3, 7, 128  # 21 rows: the last program of 16 has 5
    wide = torch.randn(tokens, 40 + heads * dim, generator=gen) * torch.logspace(-10, 10, tokens)[:, None]
    wide[0, 40 : 40 + dim] = 0  # an all-zero head
    q, weights = wide[:, 40:], wide[:, 3 : 3 + heads]
    positions = torch.tensor([0, 17, 100000])
    inv_freq = rope_inv_freq(64, 160000.0, None)
    ref = index_queries_reference(q, heads, positions, inv_freq, weights, 0.125, quant_sim)
    got = index_queries_triton(q, heads, positions, inv_freq, weights, 0.125, quant_sim)
    assert got[0].shape == ref[0].shape == (tokens, heads, dim) and torch.equal(got[1], ref[1])
    if quant_sim:  # an fp32 cos / sin a last bit off may move a value across an FP4 rounding boundary
        assert (got[0] != ref[0]).float().mean() < 0.01
    else:
        torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-6)


def test_norm_and_rope_kernels_read_strided_rows():
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(5, 3 * 128 + 32, generator=gen)
    x = wide[:, 32:].view(5, 3, 128)  # tokens at a stride, each token's heads contiguous
    positions = torch.tensor([0, 1, 50, 7, 1000])
    inv_freq = rope_inv_freq(64, 10000.0, None)
    assert torch.equal(rms_rope_triton(x, positions, inv_freq, 1e-6), rms_rope_triton(x.contiguous(), positions,
                                                                                        inv_freq, 1e-6))  # fmt: skip
    assert torch.equal(rope_triton(x, positions, inv_freq), rope_triton(x.contiguous(), positions, inv_freq))
    weight = torch.rand(128, generator=gen)
    rows = wide[:, 32:160]
    assert torch.equal(rms_norm_triton(rows, weight, 1e-6), rms_norm_triton(rows.contiguous(), weight, 1e-6))
    torch.testing.assert_close(rms_norm_triton(rows, weight, 1e-6), rms_norm_reference(rows, weight, 1e-6))
