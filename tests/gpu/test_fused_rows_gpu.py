"""The FP8 main-row write and the index-query FP4 simulation on a GPU at V4-Flash sizes (head dim 512 with 64 RoPE
channels, index queries 64 x 128), bit for bit against their references, and inside a captured CUDA graph."""

from __future__ import annotations

import pytest
import torch

from engine.cache.kv_cache import MainRows
from engine.kernels.kv_rows import write_main_rows_reference, write_main_rows_triton
from engine.kernels.quant import (
    hadamard_rotate,
    simulate_index_fp4,
    simulate_index_fp4_reference,
    simulate_index_fp4_triton,
)
from tests.gpu.graphs import capture

pytestmark = pytest.mark.gpu
DEV = "cuda"
HEAD_DIM, ROPE = 512, 64
NOPE = HEAD_DIM - ROPE


def _clear_of_powers_of_two(amax: torch.Tensor, qmax: float, floor: float) -> bool:
    """Whether no block's amax / qmax sits just above a power of two. The references take a block's exponent as
    ceil(log2) of that fp32 quotient, the kernels from its bits. For a quotient m ulps above 2**k, log2 is k + 1.44 m
    ulps of 1, and log2's own ulp near k is |k| times that or less (within 2x), so a log2 good to an ulp may round it
    onto k when m < ~|k|: the test data keeps m = 0 or m > 2|k|."""
    bits = (amax.float().clamp_min(floor) / qmax).view(torch.int32)
    mantissa, k = bits & 0x7FFFFF, (bits >> 23) - 127
    return bool(((mantissa == 0) | (mantissa > 2 * k.abs())).all())


def _magnitudes(n: int) -> torch.Tensor:
    """1, then 1e5 ... 1e30, 1e-30 ... 1e-5 in turn."""
    return 10.0 ** (((torch.arange(n) + 6) % 13) * 5 - 30).float()


def _rows(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """KV rows [n, 512] over 60 decades of magnitude, with all-zero scale blocks."""
    rows = torch.randn(n, HEAD_DIM, generator=torch.Generator().manual_seed(seed)) * _magnitudes(n)[:, None]
    rows[0, 64:128] = 0
    rows[1:2, :NOPE] = 0
    rows = rows.to(dtype)
    assert _clear_of_powers_of_two(rows[:, :NOPE].float().unflatten(-1, (-1, 64)).abs().amax(-1), 448.0, 1e-30)
    return rows.to(DEV)


def _slots(n: int, rows_per_page: int, pages: int, seed: int) -> torch.Tensor:
    """n distinct slots: the storage's last row, the first page's last row, then random ones."""
    ends = torch.tensor([pages * rows_per_page - 1, rows_per_page - 1])
    others = torch.randperm(pages * rows_per_page, generator=torch.Generator().manual_seed(seed))
    return torch.cat([ends, others[~torch.isin(others, ends)]])[:n].to(DEV)


def _storage(pages: int, rows_per_page: int, seed: int) -> torch.Tensor:
    """FP8 pages of random bytes: a write must leave every byte it does not own as it was."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (pages, rows_per_page * 584), dtype=torch.uint8, generator=gen).to(DEV)


def _queries(tokens: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Index queries [tokens, 64, 128] over 60 decades of magnitude, with all-zero 32-blocks."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, 64, 128, generator=gen) * _magnitudes(tokens * 64).view(tokens, 64, 1)
    q[0, 0] = 0
    q[0, 1, 32:64] = 0
    q = q.to(dtype)
    rotated = hadamard_rotate(q).float().unflatten(-1, (-1, 32)).abs().amax(-1)
    assert _clear_of_powers_of_two(rotated, 6.0, torch.finfo(torch.float32).tiny * 6.0)
    return q.to(DEV)


@pytest.mark.parametrize("rows_per_page", [64, 128])  # compressed pages, window rings
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [1, 16, 64])
def test_row_write_at_flash_sizes(n, dtype, rows_per_page):
    pages = n + 3
    rows, slots = _rows(n, dtype, seed=n), _slots(n, rows_per_page, pages, seed=n)
    ref = _storage(pages, rows_per_page, seed=n)
    got = ref.clone()
    write_main_rows_reference(ref, slots, rows, rows_per_page, ROPE)
    write_main_rows_triton(got, slots, rows, rows_per_page, ROPE)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 16, 64, 257])  # decode batches, a prefill chunk
def test_index_fp4_at_flash_sizes(tokens, dtype):
    q = _queries(tokens, dtype, seed=tokens)
    got = simulate_index_fp4_triton(q)
    assert got.dtype == dtype and torch.equal(got, simulate_index_fp4_reference(q))


def test_fused_kernels_capture_into_a_cuda_graph_and_replay():
    """MainRows.write and simulate_index_fp4 (the dispatchers the model calls), captured once: a replay on new rows,
    slots and queries stores and returns what the references give."""
    n, rows_per_page, pages = 16, 128, 17
    ring = MainRows(pages, rows_per_page, HEAD_DIM, ROPE, "fp8_e4m3", DEV)
    rows, slots, q = _rows(n, torch.bfloat16, 1), _slots(n, rows_per_page, pages, 1), _queries(n, torch.bfloat16, 1)
    first = (rows.clone(), slots.clone())

    def step():
        ring.write(slots, rows)
        return simulate_index_fp4(q)

    graph, captured = capture(step)
    rows.copy_(_rows(n, torch.bfloat16, 2))
    slots.copy_(_slots(n, rows_per_page, pages, 2))
    q.copy_(_queries(n, torch.bfloat16, 2))
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.zeros_like(ring.storage)
    for step_rows, step_slots in (first, (rows, slots)):  # the warm-up's write, then the replay's
        write_main_rows_reference(expected, step_slots, step_rows, rows_per_page, ROPE)
    assert torch.equal(ring.storage, expected)
    assert torch.equal(captured, simulate_index_fp4_reference(q))
