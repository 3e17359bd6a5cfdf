"""The model run on its own, outside serving: boot's warm-up, benchmarks and tests. A block manager of its own over
the cache bound to the model hands each request a slot and pages that grow with its tokens, and each call builds
the batch's tables from them. Serving runs the model through the scheduler, which owns the block manager, and the
step runner, which keeps the tables on the device (engine/model_runner.py)."""

from __future__ import annotations

import torch

from engine.cache.block_manager import BlockManager, PageTable
from engine.cache.kv_cache import ModelKVCache, kv_dtype_for
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.state import ForwardBatch, SequenceState


class Standalone:
    def __init__(self, model: DeepseekV4, cache: ModelKVCache):
        model.bind_kv_cache(cache)
        self.model, self.kv_cache = model, cache
        self.blocks = BlockManager(cache.num_pages, cache.page_size, cache.num_slots)
        self._tables: dict[int, PageTable] = {}

    @classmethod
    def allocate(
        cls, model: DeepseekV4, num_pages: int, num_slots: int, kv_dtype: str = "auto", page_size: int = 256
    ) -> Standalone:
        """A cache of its own for `model`: `num_pages` pages, `num_slots` requests at once."""
        device = model.embed.weight.device
        rows = kv_dtype_for(kv_dtype, device, model.dtype)
        return cls(model, ModelKVCache(model.args, num_pages, page_size, num_slots, rows, device))

    def new_state(self) -> SequenceState:
        slot = self.blocks.take_slot()
        self.kv_cache.reset_slot(slot)
        self._tables[slot] = PageTable()
        return SequenceState(slot)

    def release_state(self, state: SequenceState) -> None:
        self._tables.pop(state.slot).release(self.blocks)
        self.blocks.free_slot(state.slot)

    def prepare(self, batch: ForwardBatch) -> None:
        """Grow each request's pages to cover its new tokens and give the batch its device-side tables."""
        device = batch.input_ids.device
        tables = [self._tables[state.slot] for state in batch.states]
        for state, table, start, n in zip(batch.states, tables, batch.starts, batch.lens, strict=True):
            first = int(batch.positions[start])
            if first != state.num_tokens:
                raise ValueError(f"request continues at position {first} but has processed {state.num_tokens} tokens")
            table.grow(self.blocks, first + n)  # raises OutOfPages
        width = max(len(table.pages) for table in tables)
        page_table = torch.zeros(len(tables), width, dtype=torch.int32)
        for i, table in enumerate(tables):
            page_table[i, : len(table.pages)] = torch.tensor(table.pages, dtype=torch.int32)
        slots = torch.tensor([state.slot for state in batch.states], dtype=torch.int32, device=device)
        batch.set_tables(page_table.to(device), slots)

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        """The residual streams [N, hc, D] of the batch's tokens; each request's state advances."""
        self.prepare(batch)
        return self.model(batch)

    def __getattr__(self, name: str):
        return getattr(self.model, name)  # logits, layers, args, ... : the model's own
