"""The boot warm-up's chunk sizes: every launch shape a step can make, so no kernel variant is compiled after boot."""

from __future__ import annotations

from engine.boot import WARM_EVERY_SIZE_UP_TO, warm_up_chunks


def test_every_size_up_to_64_then_powers_of_two_and_one_less_up_to_the_budget():
    sizes = warm_up_chunks(4096, 1 << 20)
    assert sizes[:WARM_EVERY_SIZE_UP_TO] == list(range(1, WARM_EVERY_SIZE_UP_TO + 1))
    assert sizes[WARM_EVERY_SIZE_UP_TO:] == [127, 128, 255, 256, 511, 512, 1023, 1024, 2047, 2048, 4095, 4096]


def test_a_budget_that_is_no_power_of_two_is_warmed_itself_and_one_less():
    assert warm_up_chunks(3000, 1 << 20)[-4:] == [2047, 2048, 2999, 3000]


def test_no_chunk_is_longer_than_the_room_or_the_budget():
    assert warm_up_chunks(4096, 300) == list(range(1, 65)) + [127, 128, 255, 256]
    assert warm_up_chunks(16, 1 << 20) == list(range(1, 17))
