"""The boot warm-up's chunk sizes: every launch shape a step can make, so no kernel variant is compiled after boot,
and every row count a plain GEMM runs at, so cuBLAS has chosen its kernel for each."""

from __future__ import annotations

from engine.boot import WARM_EVERY_SIZE_UP_TO, warm_up_chunks
from engine.kernels.dispatch import GEMM_EXACT_ROWS, gemm_rows


def test_every_size_up_to_64_then_powers_of_two_and_one_less_up_to_the_budget():
    sizes = warm_up_chunks(4096, 1 << 20)
    assert sizes[:WARM_EVERY_SIZE_UP_TO] == list(range(1, WARM_EVERY_SIZE_UP_TO + 1))
    assert {127, 128, 255, 256, 511, 512, 1023, 1024, 2047, 2048, 4095, 4096} <= set(sizes)


def test_a_budget_that_is_no_power_of_two_is_warmed_itself_and_one_less():
    assert warm_up_chunks(3000, 1 << 20)[-3:] == [2816, 2999, 3000]


def test_no_chunk_is_longer_than_the_room_or_the_budget():
    assert max(warm_up_chunks(4096, 300)) == 288
    assert warm_up_chunks(16, 1 << 20) == list(range(1, 17))


def test_gemm_rows_are_eight_sizes_an_octave_and_never_an_eighth_more():
    assert [gemm_rows(n) for n in (1, 63, 64)] == [1, 63, 64]
    assert [gemm_rows(n) for n in (65, 72, 73, 128, 129, 1500, 1536, 1537, 8192)] == [
        72, 72, 80, 128, 144, 1536, 1536, 1664, 8192]  # fmt: skip
    for n in range(GEMM_EXACT_ROWS + 1, 20000):
        assert n <= gemm_rows(n) <= n * 9 / 8 and gemm_rows(gemm_rows(n)) == gemm_rows(n)
    octave = {gemm_rows(n) for n in range(1025, 2049)}
    assert len(octave) == 8


def test_the_warm_up_meets_every_gemm_row_count_a_step_of_the_budget_can_run():
    for budget in (3000, 4096, 8192):
        warmed = {gemm_rows(n) for n in warm_up_chunks(budget, 1 << 20)}
        assert {gemm_rows(n) for n in range(1, budget + 1)} <= warmed
