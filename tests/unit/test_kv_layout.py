"""KV bytes per token and per request for V4-Flash (reference §11.3), and the page pool's accounting."""

from __future__ import annotations

import pytest

from engine.cache.layout import KVLayout
from engine.cache.pool import OutOfPages, PagePool, PageTable

FLASH = dict(
    head_dim=512, rope_dim=64, index_head_dim=128, window=128, n_c4_layers=21, n_c128_layers=20, n_window_layers=44
)


def test_flash_fp8_rows_and_bytes_per_token():
    layout = KVLayout(page_size=256, kv_dtype="fp8_e4m3", **FLASH)
    assert layout.main_row_bytes == 584 and layout.index_row_bytes == 132
    # c4: (584 + 132) / 4 = 179 B per token per layer; c128: 584 / 128 = 4.5625 B.
    assert layout.bytes_per_token == pytest.approx(21 * 179 + 20 * 584 / 128)
    assert layout.pages_for(1) == 1 and layout.pages_for(256) == 1 and layout.pages_for(257) == 2


def test_bf16_rows_are_twice_the_channels():
    layout = KVLayout(page_size=256, kv_dtype="bfloat16", **FLASH)
    assert layout.main_row_bytes == 1024 and layout.index_row_bytes == 256


def test_pool_hands_out_pages_and_counts_capacity_from_them():
    pool = PagePool(num_pages=4, page_size=256)
    assert pool.capacity_tokens == 1024 and pool.used_tokens == 0
    table = PageTable()
    table.grow(pool, 300)
    assert table.pages == [0, 1] and pool.used_tokens == 512
    table.grow(pool, 512)  # still two pages
    assert len(table.pages) == 2
    other = PageTable()
    with pytest.raises(OutOfPages, match="3 pages asked, 2 free of 4"):
        other.grow(pool, 700)
    assert other.pages == [] and pool.num_free == 2
    assert table.slots(69, 71, 64).tolist() == [1 * 64 + 5, 1 * 64 + 6]  # c4 rows 69, 70 are in the second page
    table.release(pool)
    assert pool.num_free == 4 and table.pages == []
