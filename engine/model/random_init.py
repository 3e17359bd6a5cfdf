"""Seeded random weights for a model's shape: the tiny test checkpoint, and `load_format=dummy`, which serves a
model's real widths without its weights (benchmarks; nothing is read from or written to disk).

Quantized weights are drawn as codes and power-of-two block scales in their own format, so a full-width model never
exists in bf16 first. Matrices give unit-variance outputs for unit-variance inputs, so activations stay O(1) through
the depth; every tensor that a framework would initialise to zero or one (sinks, biases, position biases) is
randomised, so that parity tests cannot pass by accident (reference §15b.4); hash-routing rows hold distinct experts.
"""

from __future__ import annotations

import math

import torch

from engine.model.deepseek_v4 import DeepseekV4
from engine.model.weights import checkpoint_tensors

FP8_CODE_STD = 16.0  # random e4m3 codes' spread (their scale makes the weight's std)
FP4_CODE_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # of e2m1 codes drawn uniformly
NVFP4_SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")
NVFP4_GLOBAL = 2.0**-8


@torch.no_grad()
def randomize(model: DeepseekV4, seed: int) -> DeepseekV4:
    """Fill every tensor in place, on the model's device, in checkpoint order and by checkpoint name: the values
    do not depend on how the layers merge their members."""
    device = model.embed.weight.device
    gen = torch.Generator(device).manual_seed(seed)
    experts = model.args.n_routed_experts
    tensors = checkpoint_tensors(model)
    for name, tensor in tensors.items():
        if name.endswith("tid2eid"):  # each token routes to k distinct experts: the first k of a random order
            order = torch.rand(tensor.shape[0], experts, generator=gen, device=device).argsort(dim=-1)
            tensor.copy_(order[:, : tensor.shape[1]])
            continue
        if name.endswith(".scale"):  # a quantized weight's block scales: a power of two near std / the codes' RMS
            weight = tensors[name.removesuffix("scale") + "weight"]
            cols = weight.shape[-1] * (2 if weight.dtype == torch.int8 else 1)
            rms = FP4_CODE_RMS if weight.dtype == torch.int8 else FP8_CODE_STD
            tensor.copy_(torch.full(tensor.shape, 2.0 ** round(math.log2(cols**-0.5 / rms)), device=device))
        elif name.endswith(NVFP4_SCALES):  # NVFP4: a global 2**-8, its e4m3 block scales make std / the codes' RMS
            cols = 2 * tensors[name.rsplit(".", 1)[0] + ".weight"].shape[-1]
            value = {"weight_scale": cols**-0.5 / FP4_CODE_RMS / NVFP4_GLOBAL, "weight_scale_2": NVFP4_GLOBAL,
                     "input_scale": 1.0}[name.rsplit(".", 1)[1]]  # fmt: skip
            tensor.copy_(torch.full(tensor.shape, value, device=device))
        elif tensor.dtype == torch.float8_e4m3fn:  # e4m3 codes, std FP8_CODE_STD (made here, never as bf16 first)
            tensor.copy_(torch.randn(tensor.shape, generator=gen, device=device).mul_(FP8_CODE_STD).clamp_(-448, 448))
        elif tensor.dtype == torch.int8:  # packed e2m1 pairs: every code equally likely
            tensor.copy_(torch.randint(-128, 128, tensor.shape, generator=gen, device=device, dtype=torch.int8))
        else:
            std, mean = _initial_std_mean(name, tensor)
            tensor.copy_(
                torch.randn(tensor.shape, generator=gen, device=device, dtype=tensor.dtype).mul_(std).add_(mean)
            )
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
