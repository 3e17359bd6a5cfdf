"""Tensor names of the three checkpoint layouts and the engine's own (reference §10, §15b.2, §15b.3).

- official: `layers.{i}.attn.wq_a.weight`, per-expert `ffn.experts.{e}.w1.weight`, FP8/FP4 sidecars `<linear>.scale`;
- Hugging Face (transformers 5.23, `save_original_format=False`): `model.layers.{i}.self_attn.q_a_proj.weight`,
  stacked `mlp.experts.gate_up_proj`, FP8 sidecars `<linear>.weight_scale_inv`;
- Hugging Face default save (`save_original_format=True`): mostly the official suffixes under `model.`, with
  `lm_head.weight`, `model.embed_tokens.weight`, and the compressor / indexer names of `HF_SAVED_LAYER_NAMES`
  (what transformers 5.23 really writes: its reverse mapping is partial).

Every source name is first canonicalised to the official one. Layers that own their weights know their members'
official names (engine/model/weights.py); the model's other parameters have the official names with the
hyper-connection parameters grouped (`hc_attn.fn` for `hc_attn_fn`).
"""

from __future__ import annotations

import re

# Per-layer Hugging Face suffix -> official suffix.
HF_LAYER_NAMES = {
    **{f"{hf}_hc.{p}": f"hc_{hf}_{p}" for hf in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    # Stacked experts keep a name of their own; the loader splits gate_up into w1 (rows < I) and w3.
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up_proj",
    "mlp.experts.down_proj": "ffn.experts.down_proj",
}
OFFICIAL_LAYER_NAMES = {v: k for k, v in HF_LAYER_NAMES.items()}
# Per-layer names of transformers' default save that are neither its own nor official -> official.
HF_SAVED_LAYER_NAMES = {
    "attn.norm.weight": "attn.kv_norm.weight",
    "attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "attn.compressor.position_bias": "attn.compressor.ape",
    "attn.compressor.indexer.wkv.weight": "attn.indexer.compressor.wkv.weight",
    "attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "attn.compressor.indexer.norm.weight": "attn.indexer.compressor.norm.weight",
    "attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
}
HF_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}
OFFICIAL_GLOBAL_NAMES = {v: k for k, v in HF_GLOBAL_NAMES.items()}
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_HC_INTERNAL = re.compile(r"(^|\.)hc_(attn|ffn|head)\.(fn|base|scale)$")


def canonical_name(name: str) -> str:
    """Any layout's tensor name -> the official name (FP8 `weight_scale_inv` sidecars become `scale`)."""
    if name.endswith(".weight_scale_inv"):
        return canonical_name(name[: -len("_scale_inv")])[: -len("weight")] + "scale"
    if name in HF_GLOBAL_NAMES:
        return HF_GLOBAL_NAMES[name]
    if match := _HF_LAYER.match(name):
        layer, suffix = match.groups()
        return f"layers.{layer}.{HF_LAYER_NAMES.get(suffix) or HF_SAVED_LAYER_NAMES.get(suffix, suffix)}"
    return name.removeprefix("model.")


def official_to_hf(name: str) -> str:
    """Official name -> Hugging Face (`save_original_format=False`) name; MTP tensors keep the official name,
    which transformers ignores on load."""
    if name in OFFICIAL_GLOBAL_NAMES:
        return OFFICIAL_GLOBAL_NAMES[name]
    if name.startswith("layers."):
        _, layer, suffix = name.split(".", 2)
        return f"model.layers.{layer}.{OFFICIAL_LAYER_NAMES.get(suffix, suffix)}"
    return name


def internal_to_official(name: str) -> str:
    return _HC_INTERNAL.sub(r"\1hc_\2_\3", name)


def routed_expert_part(name: str) -> tuple[str, str] | None:
    """`layers.3.ffn.experts.5.w1.weight` -> (`layers.3.ffn`, `5.w1.weight`); None for any other tensor (the shared
    expert included)."""
    prefix, sep, part = name.rpartition(".experts.")
    return (prefix, part) if sep else None
