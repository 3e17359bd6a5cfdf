"""The tiny checkpoint, made once per session by the engine's own tool."""

from __future__ import annotations

import pytest
import torch

from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.standalone import Standalone
from engine.tools.make_tiny import make_tiny


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture(scope="session")
def prompt_ids():
    """330 tokens: 82 c4 rows (>> index_topk 8, so the selection matters), 2 c128 rows, past the 16-token window."""
    return torch.randint(2, 1024, (330,), generator=torch.Generator().manual_seed(7))


def load_with_cache(model_dir, pages: int = 64, slots: int = 8, **kwargs) -> Standalone:
    """The model on its own with a paged KV cache of its own (the serving runtime sizes it from memory instead)."""
    return Standalone.allocate(load_model(model_dir, **kwargs), pages, slots)


def prefill_logits(model, ids: torch.Tensor) -> torch.Tensor:
    state = model.new_state()
    try:
        with torch.no_grad():
            return model.logits(model(ForwardBatch(ids, torch.arange(len(ids)), [state], [len(ids)])))
    finally:
        model.release_state(state)


@pytest.fixture(scope="session")
def fp32_model(tiny_dir):
    return load_with_cache(tiny_dir, dtype=torch.float32, quant_sim=False)


@pytest.fixture(scope="session")
def fp32_model_quant_sim(tiny_dir):
    return load_with_cache(tiny_dir, dtype=torch.float32, quant_sim=True)
