"""What the model keeps about one request between steps, and the flattened batch it runs on.

The KV rows themselves live in the paged cache (engine/cache/kv_cache.py); a request holds a window-ring slot there
and pages that hold its compressed rows and index keys, both handed out by the scheduler's block manager. The model
sees them only as a step's device-side tables: each request's row of page ids and its slot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class SequenceState:
    """`num_tokens` positions of this request have been processed; its window ring and compressor state are in
    `slot`."""

    slot: int
    num_tokens: int = 0


@dataclass
class ForwardBatch:
    """Tokens of several requests flattened into one axis: request i owns rows [starts[i], starts[i] + lens[i])."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    states: list[SequenceState]
    lens: list[int]
    starts: list[int] = field(init=False)
    # Set by the model before its layers run: one token per request takes the kernels' decode path.
    decoding: bool = field(init=False, default=False)
    slots: torch.Tensor | None = field(init=False, default=None)  # [B] int32 window-ring slots
    positions_i32: torch.Tensor | None = field(init=False, default=None)  # [B] int32, decode only
    page_table: torch.Tensor | None = field(init=False, default=None)  # [B, max pages] int32
    # Data-parallel ranks: the token rows every rank pads its batch to for the MoE's gathers, agreed for the step;
    # None when every rank runs a batch of this one's shape (boot's warm-up, the decode graphs' capture).
    moe_rows: int | None = field(init=False, default=None)
    # Snapshots between two rows of one request's prompt (a cached prefix's boundary inside its chunk): after row i,
    # each layer copies the request's slot (source) into a snapshot slot (destination), [1] int64 each.
    snapshots_after: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(init=False, default_factory=dict)
    # Tensors a step derives once for all its layers (`per_step`): key -> (the layer that made it, value).
    _per_step: dict[Any, tuple[int, Any]] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.starts = []
        offset = 0
        for n in self.lens:
            self.starts.append(offset)
            offset += n

    def set_tables(self, page_table: torch.Tensor, slots: torch.Tensor) -> None:
        """Device-side tables for the layers; a batch of one token per request takes the kernels' decode path (not
        one whose rows split a request: its rows run in order)."""
        self.page_table, self.slots = page_table, slots
        self.decoding = all(n == 1 for n in self.lens) and not self.snapshots_after
        if self.decoding:
            self.positions_i32 = self.positions.int()

    def per_step(self, key, layer_id: int, make: Callable[[], Any]) -> Any:
        """A value of this step that every layer derives alike from the batch's inputs (e.g. the compressed-row
        lists of a layer kind), made by the first layer that asks and reused by the others. A layer runs once a
        step, so one asking again for what it made itself is in a new step over the same batch (a CUDA graph's
        warm-up, then its capture; each replay): it makes the value again, inside whatever is being captured."""
        made = self._per_step.get(key)
        if made is None or made[0] == layer_id:
            made = self._per_step[key] = (layer_id, make())
        return made[1]

    def row_slots(self, i: int, start: int, end: int, rows_per_page: int) -> torch.Tensor:
        """Physical slots of request i's rows [start, end) of a kind that keeps `rows_per_page` rows a page (64 c4
        rows, 2 c128 rows): row r lives in page page_table[i, r // rows_per_page]."""
        rows = torch.arange(start, end, device=self.page_table.device)
        return self.page_table[i, rows // rows_per_page].long() * rows_per_page + rows % rows_per_page
