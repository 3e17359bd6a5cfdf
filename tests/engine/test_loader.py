"""Loading the three checkpoint layouts, the FP8/FP4 official format, and clear errors that name the tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.kernels.quant import dequantize_fp4_weight, dequantize_fp8_weight, quantize_fp4_weight, quantize_fp8_weight
from engine.model.args import ModelArgs, ModelConfigError
from engine.model.loader import CheckpointError, load_model
from engine.model.weights import checkpoint_tensors
from engine.standalone import Standalone
from engine.tools.convert_official import FP4_EXPERTS, FP8_LINEARS, convert
from tests.engine.conftest import load_with_cache, prefill_logits


@pytest.fixture(scope="module")
def official_dir(tiny_dir, tmp_path_factory):
    return convert(tiny_dir, tmp_path_factory.mktemp("official") / "tiny-official")


def test_official_layout_uses_the_official_names_dtypes_and_scales(official_dir):
    tensors = load_file(official_dir / "model.safetensors")
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert tensors["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.2.ffn.experts.5.w1.weight"].dtype == torch.int8  # packed e2m1 pairs
    assert tensors["layers.2.ffn.experts.5.w1.weight"].shape == (64, 128)
    assert tensors["layers.2.ffn.experts.5.w1.scale"].shape == (64, 256 // 32)
    assert tensors["layers.2.attn.indexer.compressor.ape"].dtype == torch.float32
    assert tensors["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert tensors["hc_head_fn"].dtype == torch.float32 and "mtp.0.e_proj.scale" in tensors
    assert json.loads((official_dir / "config.json").read_text())["expert_dtype"] == "fp4"


def test_official_fp8_fp4_checkpoint_loads_as_the_dequantised_weights(tiny_dir, official_dir, prompt_ids):
    original = load_with_cache(tiny_dir, dtype=torch.float32, quant_sim=False)
    quantised = load_with_cache(official_dir, dtype=torch.float32, quant_sim=False, weight_formats="dequantized")
    reference, loaded = checkpoint_tensors(original), checkpoint_tensors(quantised)
    stored = load_file(official_dir / "model.safetensors")
    assert loaded.keys() == reference.keys() == stored.keys() - {n for n in stored if n.endswith(".scale")}
    for name, want in reference.items():
        got = loaded[name]
        if FP4_EXPERTS.search(name):
            assert torch.equal(got, dequantize_fp4_weight(*quantize_fp4_weight(want)))
            assert (got - want).abs().max() <= want.abs().max() / 3  # half an e2m1 step <= the block scale
        elif FP8_LINEARS.search(name):
            assert torch.equal(got, dequantize_fp8_weight(*quantize_fp8_weight(want)))
            assert (got - want).abs().max() <= want.abs().max() / 16  # e4m3 keeps 3 mantissa bits
        else:  # stored in the official dtype (norms in bf16, mixing weights in fp32), loaded exactly
            assert torch.equal(got, stored[name].to(got.dtype)), name
    # The model still computes nearly the same function: quantisation error, not a layout error.
    a, b = prefill_logits(original, prompt_ids[:200]), prefill_logits(quantised, prompt_ids[:200])
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > 0.9  # FP4 experts on random weights
    assert FP4_EXPERTS.search("layers.2.ffn.experts.5.w1.weight")


def test_transformers_default_save_layout_loads(tiny_dir, tmp_path, prompt_ids):
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    hf.save_pretrained(tmp_path)  # official suffixes under `model.`, MTP dropped
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "lm_head.weight" in names and "model.layers.2.attn.wq_a.weight" in names
    assert "model.layers.2.attn.compressor.indexer.scorer.weights_proj.weight" in names
    model = load_with_cache(tmp_path, dtype=torch.float32, quant_sim=False)
    assert len(model.mtp) == 0
    reference = load_with_cache(tiny_dir, dtype=torch.float32, quant_sim=False)
    assert torch.equal(prefill_logits(model, prompt_ids[:64]), prefill_logits(reference, prompt_ids[:64]))


def test_config_current_and_legacy_keys_give_the_same_model_args(tiny_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.DeepseekV4Config.from_pretrained(tiny_dir).save_pretrained(tmp_path)
    current = json.loads((tmp_path / "config.json").read_text())
    assert "layer_types" in current and "rope_parameters" in current and "compress_ratios" not in current
    legacy_args, current_args = ModelArgs.from_model_dir(tiny_dir), ModelArgs.from_config(current)
    # transformers drops the MTP entry of compress_ratios; everything else must agree.
    assert current_args.compress_ratios == legacy_args.compress_ratios
    assert current_args == legacy_args


def _copy(tiny_dir, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, dst)
    return dst


def test_missing_tensor_is_named(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"layers\.2\.attn\.indexer\.wq_b\.weight.*q_b_proj"):
        load_model(ckpt, dtype=torch.float32)


def test_wrong_shape_names_expected_and_found(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.layers.1.self_attn.kv_proj.weight"] = torch.zeros(64, 256, dtype=torch.bfloat16)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"kv_proj\.weight.*expected shape \(128, 256\), found \(64, 256\)"):
        load_model(ckpt, dtype=torch.float32)


def test_unsupported_dtype_is_named(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(256, dtype=torch.int16)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*unsupported dtype torch\.int16"):
        load_model(ckpt, dtype=torch.float32)


def test_unknown_architecture_is_refused(tiny_dir, tmp_path):
    ckpt = _copy(tiny_dir, tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    config.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match="unsupported architecture.*LlamaForCausalLM"):
        load_model(ckpt)


def test_missing_weights_and_config(tmp_path):
    with pytest.raises(ModelConfigError, match="no config.json"):
        load_model(tmp_path)


def test_loading_reports_progress(tiny_dir):
    seen = []
    load_model(tiny_dir, dtype=torch.float32, progress=lambda done, total: seen.append((done, total)))
    assert seen[0][0] == 1 and seen[-1][0] == seen[-1][1] == len(seen)


def test_dummy_load_format_makes_seeded_weights_from_the_config_alone(tiny_dir, tmp_path):
    """`load_format=dummy` needs only config.json: the model's shapes and fp32-kept parameters, seeded random
    weights (the same each time), hash rows of distinct experts, and a forward that gives finite logits."""
    shutil.copy(tiny_dir / "config.json", tmp_path / "config.json")
    loaded = load_model(tiny_dir, dtype=torch.bfloat16)
    first = load_model(tmp_path, dtype=torch.bfloat16, load_format="dummy")
    second = load_model(tmp_path, dtype=torch.bfloat16, load_format="dummy")
    for (name, real), (_, made), (_, again) in zip(
        loaded.state_dict().items(), first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        assert (made.shape, made.dtype) == (real.shape, real.dtype), name
        assert torch.equal(made, again), name
    tid2eid = first.layers[0].ffn.gate.tid2eid
    assert all(len(set(row)) == tid2eid.shape[1] for row in tid2eid.tolist())
    assert torch.isfinite(prefill_logits(Standalone.allocate(first, 4, 1), torch.arange(2, 40))).all()
