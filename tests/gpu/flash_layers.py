"""One attention layer of each kind at V4-Flash widths with dummy weights, as the GPU tests build it."""

from __future__ import annotations

import math

import torch

from bench.shapes import v4_flash_width_config
from engine.model.args import ModelArgs
from engine.model.attention import Attention

ARGS = ModelArgs.from_config(v4_flash_width_config())


def flash_attention(ratio: int, device: str = "cuda") -> Attention:
    """The layer of compress ratio `ratio` (bf16, fp32 where the reference keeps fp32), no cache."""
    layer_id = list(ARGS.compress_ratios).index(ratio)
    torch.manual_seed(layer_id)
    with torch.device(device):
        attn = Attention(ARGS, layer_id, quant_sim=True)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand_like(p) * 0.2 + 0.9)
            elif name.endswith(("attn_sink", "ape")):
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-1]))
            if not name.endswith(("norm.weight", "attn_sink", "ape")):
                p.data = p.data.bfloat16()
    return attn
