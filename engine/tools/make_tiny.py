"""`python -m engine.tools.make_tiny --out DIR [--layout official|nvfp4]`: a deterministic tiny DeepSeek-V4
checkpoint in the Hugging Face layout (bf16), made by the engine's own model code, with a tokenizer carrying
DeepSeek-V4's special tokens; or the same weights in the official layout's formats (FP8 linears, MXFP4 experts) or
in ModelOpt's (NVFP4 experts), written by engine/tools/convert_official.py.

The config keeps every layer kind of V4-Flash (reference §15): window-only, c4 with the indexer (also hash-routed),
c128, and one MTP layer. Initial values avoid the parity traps of §15b.4: 16 index heads, hash rows of distinct
experts, and every tensor that transformers initialises to zero or one (sinks, biases, position biases) randomised.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.logging import configure_logging
from engine.model.args import ModelArgs
from engine.model.checkpoint_names import official_to_hf, routed_expert_part
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.random_init import randomize
from engine.model.weights import checkpoint_tensors
from engine.tools.convert_official import convert
from engine.tools.tiny_tokenizer import save_tiny_tokenizer

SEED = 20260430
TINY_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 6,
    "num_nextn_predict_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 16,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 0],
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 256,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 8,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 64,
    "num_hash_layers": 3,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def random_tiny_model(seed: int = SEED) -> DeepseekV4:
    """The tiny model with seeded random weights in fp32."""
    return randomize(DeepseekV4(ModelArgs.from_config(TINY_CONFIG)), seed)


def save_hf_checkpoint(model: DeepseekV4, out: Path, config: dict) -> None:
    """Hugging Face layout (transformers' own names, stacked experts); MTP tensors under official names."""
    out.mkdir(parents=True, exist_ok=True)
    state, experts = {}, {}
    for name, tensor in checkpoint_tensors(model).items():
        expert = routed_expert_part(name)
        if expert and not name.startswith("mtp."):
            prefix, part = expert
            e, w = part.split(".")[:2]
            experts.setdefault(prefix, {}).setdefault(w, {})[int(e)] = tensor
        else:
            state[official_to_hf(name)] = tensor
    for prefix, parts in experts.items():
        stack = {w: torch.stack([parts[w][e] for e in sorted(parts[w])]) for w in parts}
        hf = official_to_hf(f"{prefix}.experts.gate_up_proj").removesuffix("gate_up_proj")
        state[hf + "gate_up_proj"] = torch.cat([stack["w1"], stack["w3"]], dim=1)
        state[hf + "down_proj"] = stack["w2"]
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


LAYOUTS = ("hf", "official", "nvfp4")


def make_tiny(out: Path, seed: int = SEED, layout: str = "hf") -> Path:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    if layout != "hf":
        with tempfile.TemporaryDirectory() as tmp:
            experts = "nvfp4" if layout == "nvfp4" else "mxfp4"
            return convert(make_tiny(Path(tmp) / "tiny", seed), out, experts)
    model = random_tiny_model(seed).cast(torch.bfloat16)
    save_hf_checkpoint(model, out, TINY_CONFIG)
    save_tiny_tokenizer(out, TINY_CONFIG["vocab_size"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--layout", choices=LAYOUTS, default="hf",
                        help="hf: bf16; official: FP8 + MXFP4; nvfp4: FP8 + ModelOpt's NVFP4 experts")  # fmt: skip
    args = parser.parse_args()
    configure_logging()
    make_tiny(args.out, args.seed, args.layout)
    print(f"tiny checkpoint written to {args.out}")


if __name__ == "__main__":
    main()
