"""The model shape the step and serving benchmarks run: DeepSeek-V4-Flash's real widths at reduced depth, one layer
of each kind (window-only, c4 with the indexer, c128; hash- and score-routed MoE), all 256 experts, the full
vocabulary. Weights are seeded random bf16 made on the GPU (`load_format=dummy`), never written to disk, or with
`official_formats` in the official checkpoint's formats (FP8 dense linears, MXFP4 experts), made as codes and scales."""

from __future__ import annotations

import json
from pathlib import Path

from engine.tokenizer import byte_level_chars
from engine.tools.convert_official import OFFICIAL_FORMATS
from engine.tools.make_tiny import TINY_CONFIG
from engine.tools.tiny_tokenizer import save_tiny_tokenizer

# Layers: window-only + hash MoE, c4 + hash MoE, c128 + score MoE, c4 + score MoE.
COMPRESS_RATIOS = [0, 4, 128, 4]
# The real model's 43 layers (reference §2: the MTP layer's entry dropped) and its hash-routed first three.
FLASH_COMPRESS_RATIOS, FLASH_HASH_LAYERS = [0, 0] + [4, 128] * 20 + [4], 3

V4_FLASH_WIDTHS = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": len(COMPRESS_RATIOS),
    "num_nextn_predict_layers": 0,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "compress_ratios": COMPRESS_RATIOS,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 256,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "num_hash_layers": 2,
}


def v4_flash_width_config() -> dict:
    return TINY_CONFIG | V4_FLASH_WIDTHS


def write_model_dir(out: Path, official_formats: bool = False, layers: int | None = None) -> Path:
    """config.json and a tokenizer for `--load-format dummy`: the tiny tokenizer, its vocabulary padded to the
    model's with tokens that decode to `<id>`, so that every sampled id streams as text. `layers`: V4-Flash's own
    first layers (FLASH_COMPRESS_RATIOS, three hash-routed) instead of one of each kind."""
    config = v4_flash_width_config() | (OFFICIAL_FORMATS if official_formats else {})
    if layers is not None:
        ratios = FLASH_COMPRESS_RATIOS[:layers]
        config |= {"num_hidden_layers": len(ratios), "compress_ratios": ratios, "num_hash_layers": FLASH_HASH_LAYERS}
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tiny_tokenizer(out)
    tokenizer = json.loads((out / "tokenizer.json").read_text())
    vocab, chars = tokenizer["model"]["vocab"], byte_level_chars()
    for token_id in range(len(vocab), config["vocab_size"]):
        vocab["".join(chars[b] for b in f"<{token_id}>".encode())] = token_id
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    return out
