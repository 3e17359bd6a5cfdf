"""The FP8 main-row write and the index-query FP4 simulation, Triton kernel against plain-torch reference, in Triton's
interpreter at small sizes.

The interpreter converts fp32 to e4m3 / bf16 its own way (to bf16 it truncates; to e4m3 ties round up, a carry into
the exponent is lost, subnormals truncate). Where values need rounding, the checks expect the reference's arithmetic
with the interpreter's conversion, exactly; rows that need none must store the reference's bytes.
tests/gpu/test_fused_rows_gpu.py compares every byte with the reference on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from engine.cache.kv_cache import MainRows, read_main_rows
from engine.kernels import kv_rows, quant
from engine.kernels.kv_rows import write_main_rows_reference, write_main_rows_triton
from engine.kernels.quant import fp4_simulate, hadamard_rotate, simulate_index_fp4_reference, simulate_index_fp4_triton

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter tests; tests/gpu covers CUDA")

HEAD_DIM, ROPE, ROWS_PER_PAGE, PAGES = 256, 64, 8, 4  # 192 nope channels: 3 scale blocks, not a power of two
NOPE = HEAD_DIM - ROPE
ROW_BYTES = NOPE + 2 * ROPE + 8
# First and last rows of pages, the storage's last row, rows out of order.
SLOTS = torch.tensor([7, 0, 8, 15, 31, 20])


def _rows(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows from 1e-30 to 1e30, with all-zero scale blocks."""
    rows = torch.randn(len(SLOTS), HEAD_DIM, generator=gen) * torch.logspace(-30, 30, len(SLOTS))[:, None]
    rows[1, :64] = 0
    rows[3, :NOPE] = 0
    return rows.to(dtype)


def _storage(gen: torch.Generator) -> torch.Tensor:
    """Pages of random bytes: a write must leave every byte it does not own as it was."""
    return torch.randint(0, 256, (PAGES, ROWS_PER_PAGE * ROW_BYTES), dtype=torch.uint8, generator=gen)


@triton.jit
def _convert_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=i < n).to(out_ptr.dtype.element_ty), mask=i < n)


def _interpreter_convert(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 `x` converted to `dtype` as a kernel's `.to` converts it here, back in fp32."""
    x = x.float().contiguous()
    out = torch.empty(x.shape, dtype=dtype)
    _convert_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    return out.float()


def _rows_on_grid(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows already on their blocks' e4m3 grids and bf16 (as read back from the cache): encoding them rounds nothing."""
    storage = _storage(gen)
    write_main_rows_reference(storage, SLOTS, _rows(torch.float32, gen), ROWS_PER_PAGE, ROPE)
    return read_main_rows(storage, SLOTS, ROWS_PER_PAGE, HEAD_DIM, ROPE).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_write_stores_the_reference_bytes(dtype):
    gen = torch.Generator().manual_seed(0)
    rows = _rows_on_grid(dtype, gen)
    ref = _storage(gen)
    got = ref.clone()
    write_main_rows_reference(ref, SLOTS, rows, ROWS_PER_PAGE, ROPE)
    write_main_rows_triton(got, SLOTS.int(), rows, ROWS_PER_PAGE, ROPE)
    assert torch.equal(got, ref)
    write_main_rows_triton(got, SLOTS[:0], rows[:0], ROWS_PER_PAGE, ROPE)  # no rows: nothing written
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_write_matches_the_reference(dtype):
    gen = torch.Generator().manual_seed(1)
    rows = _rows(dtype, gen)
    ref = _storage(gen)
    got = ref.clone()
    write_main_rows_reference(ref, SLOTS, rows, ROWS_PER_PAGE, ROPE)
    write_main_rows_triton(got, SLOTS, rows, ROWS_PER_PAGE, ROPE)
    scales = ROWS_PER_PAGE * (NOPE + 2 * ROPE)
    assert torch.equal(got[:, scales:], ref[:, scales:])  # the ue8m0 exponents (and the untouched pad bytes)
    blocks = rows[:, :NOPE].float().unflatten(-1, (-1, 64))
    scale = quant._pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 448)
    nope = (_interpreter_convert(blocks / scale, torch.float8_e4m3fn) * scale).flatten(1)
    expected = torch.cat([nope, _interpreter_convert(rows[:, NOPE:], torch.bfloat16)], dim=1)
    ref_rows, got_rows = (read_main_rows(s, SLOTS, ROWS_PER_PAGE, HEAD_DIM, ROPE) for s in (ref, got))
    assert torch.equal(got_rows, expected)
    assert (got_rows == ref_rows).float().mean() > 0.8


def test_row_writes_go_through_the_kernel_when_chosen(monkeypatch):
    rows = _rows_on_grid(torch.float32, torch.Generator().manual_seed(2))
    launched = []
    monkeypatch.setattr(kv_rows, "write_main_rows_triton", lambda *args: launched.append(write_main_rows_triton(*args)))
    caches = {}
    for kernels in ("torch", "triton"):
        monkeypatch.setenv("FLASHGATE_KERNELS", kernels)
        caches[kernels] = MainRows(PAGES, ROWS_PER_PAGE, HEAD_DIM, ROPE, "fp8_e4m3", "cpu")
        caches[kernels].write(SLOTS, rows)
        assert len(launched) == (kernels == "triton")
    assert torch.equal(caches["triton"].storage, caches["torch"].storage)
    bf16 = MainRows(PAGES, ROWS_PER_PAGE, HEAD_DIM, ROPE, "bfloat16", "cpu")  # not FP8: stored as is, no kernel
    bf16.write(SLOTS, rows)
    assert len(launched) == 1 and torch.equal(bf16.read(SLOTS), rows)


def _queries(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Index queries [tokens, heads, 128] (21 rows of 128: the last program has 5) from 1e-20 to 1e20, with zero
    32-blocks."""
    q = torch.randn(3, 7, 128, generator=gen) * torch.logspace(-20, 20, 7)[None, :, None]
    q[0, 0] = 0
    q[1, 2, 32:64] = 0
    return q.to(dtype)


def test_index_fp4_kernel_is_the_butterfly_reference_exactly_in_fp32():
    """Its butterflies add in the reference's order, so fp32 queries come out bit for bit."""
    q = _queries(torch.float32, torch.Generator().manual_seed(3))
    assert torch.equal(simulate_index_fp4_triton(q), simulate_index_fp4_reference(q))
    rows = q[0]  # compressed index rows, [n, 128]
    assert torch.equal(simulate_index_fp4_triton(rows), simulate_index_fp4_reference(rows))


def test_index_fp4_kernel_matches_the_reference_in_bf16():
    """bf16 queries come back from the rotation in bf16 before the FP4 rounding, as in the reference."""
    q = _queries(torch.bfloat16, torch.Generator().manual_seed(4))
    got, ref = simulate_index_fp4_triton(q), simulate_index_fp4_reference(q)
    expected = fp4_simulate(_interpreter_convert(hadamard_rotate(q.float()), torch.bfloat16), 32).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert (got == ref).float().mean() > 0.95


def test_index_fp4_dispatch(monkeypatch):
    """The kernel when chosen; float64 (fp64 models) always rounds in torch, in float64."""
    monkeypatch.setattr(quant, "simulate_index_fp4_triton", lambda x: "kernel")
    q = torch.randn(2, 4, 128)
    assert torch.equal(quant.simulate_index_fp4(q), simulate_index_fp4_reference(q))  # CPU: the reference
    monkeypatch.setenv("FLASHGATE_KERNELS", "triton")
    assert quant.simulate_index_fp4(q) == "kernel"
    assert quant.simulate_index_fp4(q.double()).dtype == torch.float64
