"""KV bytes per token and per request for V4-Flash (reference §11.3), and the page pool's accounting."""

from __future__ import annotations

import pytest
import torch

from engine.cache.block_manager import BlockManager, OutOfPages, PageTable
from engine.cache.layout import KVLayout
from engine.model.state import ForwardBatch

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
    pool = BlockManager(num_pages=4, page_size=256, num_slots=2)
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
    table.release(pool)
    assert pool.num_free == 4 and table.pages == []


def test_the_block_manager_hands_out_request_slots():
    blocks = BlockManager(num_pages=1, page_size=256, num_slots=2)
    assert [blocks.take_slot(), blocks.take_slot()] == [0, 1]
    with pytest.raises(RuntimeError, match="all 2 request slots are in use"):
        blocks.take_slot()
    blocks.free_slot(0)
    assert blocks.take_slot() == 0


def test_a_step_finds_a_requests_rows_through_its_page_table():
    batch = ForwardBatch(torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long), [], [1])
    batch.set_tables(torch.tensor([[7, 3]], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    assert batch.row_slots(0, 69, 71, 64).tolist() == [3 * 64 + 5, 3 * 64 + 6]  # c4 rows 69, 70: the second page
