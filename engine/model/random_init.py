"""Seeded random weights for a model's shape: the tiny test checkpoint, and `load_format=dummy`, which serves a
model's real widths without its weights (benchmarks; nothing is read from or written to disk).

Matrices give unit-variance outputs for unit-variance inputs, so activations stay O(1) through the depth; every
tensor that a framework would initialise to zero or one (sinks, biases, position biases) is randomised, so that
parity tests cannot pass by accident (reference §15b.4); hash-routing rows hold distinct experts.
"""

from __future__ import annotations

import math

import torch

from engine.model.deepseek_v4 import DeepseekV4
from engine.model.weights import checkpoint_tensors


@torch.no_grad()
def randomize(model: DeepseekV4, seed: int) -> DeepseekV4:
    """Fill every tensor in place, on the model's device, in checkpoint order and by checkpoint name: the values
    do not depend on how the layers merge their members."""
    device = model.embed.weight.device
    gen = torch.Generator(device).manual_seed(seed)
    experts = model.args.n_routed_experts
    for name, tensor in checkpoint_tensors(model).items():
        if name.endswith("tid2eid"):  # each token routes to k distinct experts: the first k of a random order
            order = torch.rand(tensor.shape[0], experts, generator=gen, device=device).argsort(dim=-1)
            tensor.copy_(order[:, : tensor.shape[1]])
            continue
        std, mean = _initial_std_mean(name, tensor)
        tensor.copy_(torch.randn(tensor.shape, generator=gen, device=device, dtype=tensor.dtype).mul_(std).add_(mean))
    return model


def _initial_std_mean(name: str, param: torch.Tensor) -> tuple[float, float]:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 0.1, 1.0
    if leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
        return 0.5, 0.0
    if leaf.startswith("hc_") and leaf.endswith("_base"):
        return 0.5, 0.0
    if leaf.startswith("hc_") and leaf.endswith("_scale"):
        return 0.1, 1.0
    if name == "embed.weight":
        return 1.0, 0.0
    return 1.0 / math.sqrt(param.shape[-1]), 0.0
