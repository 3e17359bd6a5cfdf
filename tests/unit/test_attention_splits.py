"""How many programs share a request's keys (split-K) when the caller does not say: enough to fill the GPU once, never
more than the request's 64-row blocks, spread evenly. The CPU has no GPU to size for, so torch reports an H200's 132
multiprocessors here and splits_for's CUDA rule runs on them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels.sparse_attention import default_splits


@pytest.fixture
def h200(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(multi_processor_count=132))


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
