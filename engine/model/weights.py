"""The model's tensors by checkpoint name, both ways: what the loader fills and what the checkpoint tools write.

Layers that own their weights (linears, experts) report a `WeightEntry` per checkpoint member (`layers.0.attn.wq_a`
with its tensors `.weight`, `.scale`, ...); their parameters' own names do not matter (merged projections have
none in the checkpoint). Every other parameter, and the hash-routing tables, is a *plain tensor* stored under its
official name (engine/model/checkpoint_names.py), copied as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from engine.model.checkpoint_names import internal_to_official


@dataclass(frozen=True)
class WeightEntry:
    """One checkpoint member of a layer: `name` is the prefix of its stored tensors."""

    name: str
    load: Callable[[dict[str, torch.Tensor]], None]  # this rank's part of the stored tensors into the parameters
    stored: Callable[[], dict[str, torch.Tensor]]  # the parameters as the checkpoint stores them (whole weights)


def weight_entries(model: nn.Module) -> Iterator[WeightEntry]:
    for module in model.modules():
        if hasattr(module, "weight_entries"):
            yield from module.weight_entries()


def plain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Official name -> the parameter or table, for everything no layer's weight entries cover."""
    owned = {id(p) for m in model.modules() if hasattr(m, "weight_entries") for p in m.parameters()}
    tensors = {internal_to_official(n): p for n, p in model.named_parameters() if id(p) not in owned}
    return tensors | {n: b for n, b in model.named_buffers() if n.endswith("tid2eid")}


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor under its official checkpoint name, as the layers' formats store them."""
    tensors = {}
    for entry in weight_entries(model):
        tensors |= {f"{entry.name}.{suffix}": t for suffix, t in entry.stored().items()}
    return tensors | plain_tensors(model)
