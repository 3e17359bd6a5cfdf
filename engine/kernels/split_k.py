"""Split-K in one launch: the programs of an output tile each sum their share of K, store the fp32 partial, and take a
ticket from the tile's counter; the one that arrives last sums the partials in split order (the same order whichever
program arrives last, so the result is deterministic) and rounds once. Where weight streaming leaves too few programs
to fill the GPU (decode, few experts), splitting K adds programs without a second launch to add the splits.

The counters are one int32 buffer per device, zero between launches: the last program of a tile resets its counter,
and a tile none of whose programs run (an empty expert slot) never moves it. Launches on a device's one stream follow
each other, so every launch may use counters from 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE_COUNTERS = 1 << 16  # tiles a launch may split: wq_b's 512 decode tiles; 256 expert slots x 32 tiles of 64 rows

_counters: dict[torch.device, torch.Tensor] = {}


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's zeroed counters, made on its first split launch (which boot's warm-up runs before any CUDA graph
    is captured: a buffer made during a capture would belong to the graph's pool)."""
    if tiles > TILE_COUNTERS:
        raise ValueError(f"a split-K launch over {tiles} tiles; the counters hold {TILE_COUNTERS}")
    counters = _counters.get(device)
    if counters is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the split-K counters are made by an eager launch before any CUDA graph is captured")
        counters = _counters[device] = torch.zeros(TILE_COUNTERS, dtype=torch.int32, device=device)
    return counters


@triton.jit
def arrives_last(counter_ptr, SPLITS: tl.constexpr):
    """Whether this program is the last of SPLITS to finish its tile; call after storing the partial. The barrier
    orders every thread's store before the ticket, the ticket's acquire-release orders the other programs' stores
    before this one's reads of them (load them with cache_modifier=".cg": from L2, not a stale L1 line)."""
    tl.debug_barrier()
    last = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == SPLITS - 1
    if last:
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
    return last
