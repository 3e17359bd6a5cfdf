"""CUDA graphs of the decode step: every layer, the final norm and the head, for batch sizes 1, 2, 4, 8, 16, 32, …
up to `cuda_graph_max_bs`, captured once at boot with page tables as wide as the context length allows.

A decode step launches hundreds of small kernels; replaying them as one graph removes the launch overhead that
otherwise dominates a step at small batch. The captured grids depend only on the batch size, and every kernel
loops up to each request's actual length, so one graph serves every length up to the profile's maximum. A batch
smaller than a captured size replays the next size up, padded with rows at position 0 of a spare request slot: at
position 0 no compressor window closes and no compressed row is visible, so padding never touches a page.
"""

from __future__ import annotations

import torch

from engine.model.deepseek_v4 import DeepseekV4
from engine.model.state import ForwardBatch


def capture_sizes(max_bs: int) -> list[int]:
    return sorted({min(size, max_bs) for size in (1, 2, 4, 8, *range(16, max_bs + 16, 16))})


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, max_bs: int, max_pages: int, pad_slot: int):
        device = model.embed.weight.device
        self.model, self.pad_slot, self.sizes = model, pad_slot, capture_sizes(max_bs)
        n = self.sizes[-1]
        # Static inputs: each replay reads its batch from here.
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.positions_i32 = torch.zeros(n, dtype=torch.int32, device=device)
        self.slots = torch.full((n,), pad_slot, dtype=torch.int32, device=device)
        self.page_table = torch.zeros(n, max_pages, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None
        for size in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            batch = self._static_batch(size)
            model.logits(model.run_layers(batch))  # warm-up outside the capture: compiles the Triton kernels
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = model.logits(model.run_layers(batch))
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(device)

    def _static_batch(self, size: int) -> ForwardBatch:
        batch = ForwardBatch(self.input_ids[:size], self.positions[:size], [], [1] * size)
        batch.set_tables(self.page_table[:size], self.slots[:size])
        batch.positions_i32 = self.positions_i32[:size]  # an input too: replays must not see capture-time values
        return batch

    @property
    def memory_bytes(self) -> int:
        """What the graphs' private memory pool holds (its cudaMalloc'd segments)."""
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == self.pool)

    def replay(self, batch: ForwardBatch, size: int) -> torch.Tensor:
        """A decode batch with its tables -> its logits [B, vocab] fp32 from the graph of batch `size` (a captured
        size, at least B, the same on every rank), a view of the graph's output that the next replay overwrites."""
        bs = len(batch.states)
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.positions_i32[:bs].copy_(batch.positions_i32)
        self.slots[:bs].copy_(batch.slots)
        # Entries past a request's pages are never read (kernels stop at its length), so stale ones may stay.
        self.page_table[:bs, : batch.page_table.shape[1]].copy_(batch.page_table)
        if size > bs:
            self.input_ids[bs:size].zero_()
            self.positions[bs:size].zero_()
            self.positions_i32[bs:size].zero_()
            self.slots[bs:size].fill_(self.pad_slot)
        self.graphs[size].replay()
        return self.logits[size][:bs]
