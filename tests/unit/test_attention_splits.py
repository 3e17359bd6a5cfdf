"""How many programs share a request's keys (split-K) when the caller does not say: enough to fill the GPU once, never
more than the request's 64-row blocks, spread evenly. On the CPU splits_for has no GPU to size for, so its CUDA rule
runs here for an H200's 132 multiprocessors."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import sparse_attention
from engine.kernels.sparse_attention import default_splits


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(sparse_attention, "splits_for",
                        lambda n, device, waves, cap: max(1, min(cap, waves * 132 // n)))  # fmt: skip


@pytest.mark.parametrize(
    ("batch", "rows", "splits"),
    [
        (1, 640, 10),  # a c4 layer's 128 window + 512 selected rows are 10 blocks: one each, not 16 programs
        (16, 640, 5),  # 8 would fill the GPU, but 10 blocks over 8 programs still take two rounds: 5 take two each
        (64, 640, 2),
        (128, 640, 1),
        (1, 128, 2),  # a window-only layer: its 2 blocks
        (1, 128 + 8192, 15),  # a c128 layer at a 1M maximum, 130 blocks: up to 16 programs need 9 blocks each
        (4, 128 + 1024, 9),  # 18 blocks: 16 programs would fill the GPU, yet need 2 blocks each, as 9 do
    ],
)
def test_default_splits(h200, batch, rows, splits):
    assert default_splits(batch, 64, rows, torch.device("cuda")) == splits
