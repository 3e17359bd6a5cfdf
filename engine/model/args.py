"""Model hyperparameters, read from a checkpoint's config.json in current or legacy key names (reference §2, §15b.1)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

ARCHITECTURE = "DeepseekV4ForCausalLM"
LAYER_TYPE_RATIOS = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}


class ModelConfigError(ValueError):
    """config.json is missing, names another architecture, or holds a value this engine cannot run."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # Per layer, main layers then MTP layers: 0 = sliding window only, 4 = c4 (CSA, indexer), 128 = c128 (HCA).
    compress_ratios: tuple[int, ...]
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    num_nextn_predict_layers: int
    bos_token_id: int
    eos_token_id: int

    def block_name(self, layer_id: int) -> str:
        """The checkpoint name of a block: the main layers, then the MTP layers."""
        n = self.num_hidden_layers
        return f"layers.{layer_id}" if layer_id < n else f"mtp.{layer_id - n}"

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelArgs:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ModelConfigError(f"no config.json in {model_dir}")
        try:
            return cls.from_config(json.loads(path.read_text()))
        except json.JSONDecodeError as exc:
            raise ModelConfigError(f"{path} is not valid JSON: {exc}") from exc

    @classmethod
    def from_config(cls, cfg: dict) -> ModelArgs:
        archs = cfg.get("architectures") or []
        if ARCHITECTURE not in archs and cfg.get("model_type") != "deepseek_v4":
            raise ModelConfigError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}: this engine runs {ARCHITECTURE}"
            )
        scoring = cfg.get("scoring_func", "sqrtsoftplus")
        if scoring != "sqrtsoftplus":
            raise ModelConfigError(f"scoring_func {scoring!r} is not supported (only 'sqrtsoftplus')")
        n_layers = _req(cfg, "num_hidden_layers")
        n_mtp = cfg.get("num_nextn_predict_layers", 0)
        head_dim = _req(cfg, "head_dim")
        main_rope, compress_rope = _rope(cfg, head_dim)
        return cls(
            vocab_size=_req(cfg, "vocab_size"),
            hidden_size=_req(cfg, "hidden_size"),
            num_hidden_layers=n_layers,
            num_attention_heads=_req(cfg, "num_attention_heads"),
            head_dim=head_dim,
            qk_rope_head_dim=main_rope["rope_dim"],
            q_lora_rank=_req(cfg, "q_lora_rank"),
            o_groups=_req(cfg, "o_groups"),
            o_lora_rank=_req(cfg, "o_lora_rank"),
            sliding_window=_req(cfg, "sliding_window"),
            compress_ratios=_compress_ratios(cfg, n_layers, n_mtp),
            rope_theta=float(main_rope["rope_theta"]),
            compress_rope_theta=float(compress_rope["rope_theta"]),
            yarn=compress_rope["yarn"],
            max_position_embeddings=_req(cfg, "max_position_embeddings"),
            index_n_heads=_req(cfg, "index_n_heads"),
            index_head_dim=_req(cfg, "index_head_dim"),
            index_topk=_req(cfg, "index_topk"),
            n_routed_experts=cfg.get("n_routed_experts", cfg.get("num_local_experts")),
            num_experts_per_tok=_req(cfg, "num_experts_per_tok"),
            moe_intermediate_size=cfg.get("moe_intermediate_size", cfg.get("intermediate_size")),
            num_hash_layers=_hash_layers(cfg),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
            swiglu_limit=float(cfg.get("swiglu_limit", 0.0)),
            hc_mult=cfg.get("hc_mult", 4),
            hc_sinkhorn_iters=cfg.get("hc_sinkhorn_iters", 20),
            hc_eps=float(cfg.get("hc_eps", 1e-6)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=n_mtp,
            bos_token_id=cfg.get("bos_token_id", 0),
            eos_token_id=_first(cfg.get("eos_token_id", 1)),
        )


def _req(cfg: dict, key: str):
    if cfg.get(key) is None:
        raise ModelConfigError(f"config.json lacks {key!r}")
    return cfg[key]


def _first(value):
    return value[0] if isinstance(value, list) else value


def _compress_ratios(cfg: dict, n_layers: int, n_mtp: int) -> tuple[int, ...]:
    if "layer_types" in cfg:
        try:
            main = [LAYER_TYPE_RATIOS[t] for t in cfg["layer_types"]]
        except KeyError as exc:
            raise ModelConfigError(f"unknown layer type {exc.args[0]!r} in layer_types") from exc
        rates = cfg.get("compress_rates") or {}
        if rates and (rates.get("compressed_sparse_attention", 4), rates.get("heavily_compressed_attention", 128)) != (
            4,
            128,
        ):
            raise ModelConfigError(f"compress_rates {rates} unsupported: the kernels assume 4 and 128")
        ratios = main + [0] * n_mtp  # MTP layers are sliding-window only
    else:
        ratios = list(_req(cfg, "compress_ratios"))
        ratios += [0] * (n_layers + n_mtp - len(ratios))
    if len(ratios) < n_layers:
        raise ModelConfigError(f"{len(ratios)} layer kinds for {n_layers} layers")
    bad = sorted(set(ratios) - {0, 4, 128})
    if bad:
        raise ModelConfigError(f"compress ratio(s) {bad} unsupported: only 0, 4 and 128")
    return tuple(ratios[: n_layers + n_mtp])


def _hash_layers(cfg: dict) -> int:
    if "mlp_layer_types" in cfg:
        kinds = cfg["mlp_layer_types"]
        count = next((i for i, kind in enumerate(kinds) if kind != "hash_moe"), len(kinds))
        if "hash_moe" in kinds[count:]:
            raise ModelConfigError("hash_moe layers must come first in mlp_layer_types")
        return count
    return cfg.get("num_hash_layers", cfg.get("n_hash_layers", 0))


def _yarn(params: dict) -> YarnScaling | None:
    if params.get("rope_type", params.get("type")) != "yarn":
        return None
    return YarnScaling(
        float(params["factor"]),
        int(params["original_max_position_embeddings"]),
        float(params.get("beta_fast", 32)),
        float(params.get("beta_slow", 1)),
    )


def _rope(cfg: dict, head_dim: int) -> tuple[dict, dict]:
    """(main, compress) RoPE settings. Nested `rope_parameters` is authoritative once present (§15b.1)."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        main, comp = params["main"], params.get("compress", params["main"])
        factor = comp.get("partial_rotary_factor", main.get("partial_rotary_factor"))
        rope_dim = round(head_dim * factor) if factor else cfg.get("qk_rope_head_dim", 64)
        return {"rope_theta": main["rope_theta"], "rope_dim": rope_dim}, {
            "rope_theta": comp["rope_theta"],
            "yarn": _yarn(comp),
        }
    if "qk_rope_head_dim" in cfg:
        rope_dim = cfg["qk_rope_head_dim"]
    else:
        rope_dim = round(head_dim * cfg.get("partial_rotary_factor", 0.125))
    main = {"rope_theta": cfg.get("rope_theta", 10000.0), "rope_dim": rope_dim}
    return main, {
        "rope_theta": cfg.get("compress_rope_theta", main["rope_theta"]),
        "yarn": _yarn(cfg.get("rope_scaling") or {}),
    }
