"""The collectives the model's layers issue when it is spread over several ranks, on torch.distributed's default
group (NCCL on CUDA, gloo on the CPU). Each is one call that a CUDA graph can capture: shapes depend only on the
row count every rank passes, never on another rank's data."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# torch 2.13 renames these two *_single; the GPU machine's torch 2.11 has only the names used here.
warnings.filterwarnings("ignore", r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks, in place."""
    dist.all_reduce(x)
    return x


def gather_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """Every rank's x, zero-padded to `rows` rows (the same on every rank), stacked in rank order:
    [world * rows, ...]."""
    if len(x) > rows:
        raise ValueError(f"{len(x)} rows do not fit the {rows} every rank agreed on")
    padded = x.new_zeros(rows, *x.shape[1:])
    padded[: len(x)] = x
    out = x.new_empty(world_size() * rows, *x.shape[1:])
    dist.all_gather_into_tensor(out, padded)
    return out


def reduce_scatter_rows(x: torch.Tensor) -> torch.Tensor:
    """x [world * rows, ...] on every rank -> this rank's block of rows of their sum, [rows, ...]."""
    out = x.new_empty(len(x) // world_size(), *x.shape[1:])
    dist.reduce_scatter_tensor(out, x.contiguous())
    return out
