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


@torch.no_grad()
def randomize(model: DeepseekV4, seed: int) -> DeepseekV4:
    """Fill every parameter and the hash-routing tables in place, on the model's device."""
    device = model.embed.weight.device
    gen = torch.Generator(device).manual_seed(seed)
    for name, param in model.named_parameters():
        std, mean = _initial_std_mean(name, param)
        param.copy_(torch.randn(param.shape, generator=gen, device=device, dtype=param.dtype).mul_(std).add_(mean))
    experts = model.args.n_routed_experts
    for name, table in model.named_buffers():
        if name.endswith("tid2eid"):  # each token routes to k distinct experts: the first k of a random order
            order = torch.rand(table.shape[0], experts, generator=gen, device=device).argsort(dim=-1)
            table.copy_(order[:, : table.shape[1]])
    return model


def _initial_std_mean(name: str, param: torch.Tensor) -> tuple[float, float]:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 0.1, 1.0
    if leaf in ("attn_sink", "ape") or name.endswith("gate.bias"):
        return 0.5, 0.0
    if ".hc_" in f".{name}" and leaf == "base":
        return 0.5, 0.0
    if leaf == "scale":
        return 0.1, 1.0
    if name == "embed.weight":
        return 1.0, 0.0
    return 1.0 / math.sqrt(param.shape[-1]), 0.0
