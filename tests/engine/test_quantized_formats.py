"""Weights kept as the checkpoints store them: FP8 block-scaled dense linears and MXFP4 routed experts (the official
layout), NVFP4 routed experts (NVIDIA ModelOpt's). A rank loads only its part (at world size 2 and 4 the parts put
back together are the stored tensors, codes and scales alike), the layers compute what the kernels' references
compute on those tensors, and the tiny checkpoint in each layout serves from its stored bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.kernels.fp4_moe import PackedFp4, moe_expert_pairs_fp4_reference
from engine.kernels.fp8_gemm import fp8_block_grouped_linear_reference, fp8_block_linear_reference
from engine.kernels.quant import e8m0_to_float, quantize_fp4_weight, quantize_fp8_weight, quantize_nvfp4_weight
from engine.llm import LLM
from engine.model.linear import ColumnParallelLinear, GroupedColumnLinear, ProjectionGroup, RowParallelLinear, Shard
from engine.model.loader import CheckpointError, load_model
from engine.model.moe import Experts
from engine.model.weight_formats import Formats, Fp8BlockScaled, Mxfp4Experts, Nvfp4Experts, Unquantized
from engine.model.weights import checkpoint_tensors
from engine.sampling_params import SamplingParams
from engine.tools.convert_official import convert
from engine.tools.make_tiny import make_tiny
from tests.engine.conftest import load_with_cache, prefill_logits

GEN = torch.Generator().manual_seed(5)
FP8 = Fp8BlockScaled()


def _fp8(rows, cols):
    weight, scale = quantize_fp8_weight(torch.randn(rows, cols, generator=GEN) * 0.05)
    return {"weight": weight, "scale": scale}


def _fp4(rows, cols):
    weight, scale = quantize_fp4_weight(torch.randn(rows, cols, generator=GEN) * 0.05)
    return {"weight": weight, "scale": scale}


def _nvfp4(rows, cols):
    weight, scale, global_scale = quantize_nvfp4_weight(torch.randn(rows, cols, generator=GEN) * 0.05)
    return {"weight": weight.view(torch.uint8), "weight_scale": scale, "weight_scale_2": global_scale,
            "input_scale": torch.tensor(0.01)}  # fmt: skip


def _experts_stored(n, fmt):
    return {f"e.{i}.{w}": fmt(*shape) for i in range(n) for w, shape in
            (("w1", (64, 128)), ("w3", (64, 128)), ("w2", (128, 64)))}  # fmt: skip


def _load(layer, stored):
    for entry in layer.weight_entries():
        entry.load(stored[entry.name])
    return layer


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def official_dir(tiny_dir, tmp_path_factory):
    return convert(tiny_dir, tmp_path_factory.mktemp("official") / "tiny-official")


@pytest.fixture(scope="module")
def nvfp4_dir(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("nvfp4") / "tiny-nvfp4", layout="nvfp4")


@pytest.mark.parametrize("size", [2, 4])
def test_fp8_shards_put_back_together_are_the_stored_codes_and_scales(size):
    members = {"a.wq_b": _fp8(512, 256), "a.indexer.wq_b": _fp8(512, 256)}
    out = {"a.wo_b": _fp8(384, 512)}
    grouped = {"a.wo_a": _fp8(4 * 128, 256)}  # 4 groups of 128 rows
    columns, rows, groups = [], [], []
    for rank in range(size):
        shard = Shard(rank, size)
        layer = _load(ColumnParallelLinear(256, [("a.wq_b", 512), ("a.indexer.wq_b", 512)], FP8, shard), members)
        columns.append([layer.fmt.stored(layer.params(), row, 512 // size) for row in (0, 512 // size)])
        rows.append(_load(RowParallelLinear(512, [("a.wo_b", 384)], FP8, shard), out).params())
        groups.append(_load(GroupedColumnLinear(4, 256, 128, "a.wo_a", FP8, shard), grouped).params())
    for key in ("weight", "scale"):
        for i, name in enumerate(members):
            assert torch.equal(_bits(torch.cat([c[i][key] for c in columns])), _bits(members[name][key]))
        assert torch.equal(_bits(torch.cat([r[key] for r in rows], dim=1)), _bits(out["a.wo_b"][key]))
        assert torch.equal(_bits(torch.cat([g[key] for g in groups])), _bits(grouped["a.wo_a"][key]))
    assert columns[0][0]["weight"].dtype == torch.float8_e4m3fn and rows[0]["scale"].dtype == torch.float8_e8m0fnu


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(("fmt", "make", "keys"), [
    (Mxfp4Experts(), _fp4, ("weight", "scale")),
    (Nvfp4Experts(), _nvfp4, ("weight", "weight_scale", "weight_scale_2", "input_scale")),
], ids=["mxfp4", "nvfp4"])  # fmt: skip
def test_fp4_expert_ranges_put_back_together_are_the_stored_experts(size, fmt, make, keys):
    stored = _experts_stored(8, make)
    parts = [_load(Experts(8, 128, 64, 0.0, "e", fmt, Shard(rank, size)), stored) for rank in range(size)]
    for w in ("w1", "w3", "w2"):
        for key in keys:
            whole = torch.cat([getattr(p, w).params()[key] for p in parts])
            want = torch.stack([stored[f"e.{i}.{w}"][key].reshape(whole.shape[1:]) for i in range(8)])
            assert torch.equal(_bits(whole), _bits(want)), (w, key)
    assert parts[0].w1.weight.dtype == torch.int8


def test_row_parallel_fp8_partial_sums_add_up_to_the_whole_product():
    out = {"a.wo_b": _fp8(256, 512)}
    x = torch.randn(5, 512, generator=GEN)
    whole = _load(RowParallelLinear(512, [("a.wo_b", 256)], FP8, Shard()), out)(x)
    parts = [_load(RowParallelLinear(512, [("a.wo_b", 256)], FP8, Shard(r, 2)), out) for r in range(2)]
    summed = sum(p.fmt.linear(p.params(), x[:, r * 256 : (r + 1) * 256]) for r, p in enumerate(parts))  # no group here
    assert torch.allclose(summed, whole, rtol=1e-5, atol=1e-5)  # per-128-block products summed in another order
    assert torch.equal(whole, fp8_block_linear_reference(x, out["a.wo_b"]["weight"], out["a.wo_b"]["scale"]))


def test_fp8_layers_compute_the_block_scaled_reference_on_the_stored_tensors():
    members = {"a.wq_a": _fp8(128, 256), "a.wkv": _fp8(64, 256), "a.indexer.weights_proj": _fp8(16, 256)}
    group = ProjectionGroup(256, [(n, m["weight"].shape[0], FP8, False) for n, m in members.items()], Shard())
    _load_group = [_load(part, members) for part in group.parts]
    assert [p.names for p in _load_group] == [["a.wq_a", "a.wkv"], ["a.indexer.weights_proj"]]  # 64 rows end mid-block
    x = torch.randn(3, 7, 256, generator=GEN)
    for got, m in zip(group(x), members.values(), strict=True):
        want = fp8_block_linear_reference(x.reshape(21, 256), m["weight"], m["scale"]).view(3, 7, -1)
        assert torch.equal(got, want)
    grouped = {"a.wo_a": _fp8(2 * 64, 128)}  # groups of 64 rows: one scale block spans both (the tiny model's)
    layer = _load(GroupedColumnLinear(2, 128, 64, "a.wo_a", FP8, Shard()), grouped)
    xg = torch.randn(4, 2, 128, generator=GEN)
    want = fp8_block_grouped_linear_reference(xg, grouped["a.wo_a"]["weight"], grouped["a.wo_a"]["scale"])
    assert torch.equal(layer(xg), want)
    assert torch.allclose(want[:, 1], fp8_block_linear_reference(xg[:, 1], grouped["a.wo_a"]["weight"][64:],
                                                                 grouped["a.wo_a"]["scale"]), atol=0)  # fmt: skip


@pytest.mark.parametrize(("fmt", "make"), [(Mxfp4Experts(), _fp4), (Nvfp4Experts(), _nvfp4)], ids=["mxfp4", "nvfp4"])
def test_fp4_experts_compute_the_reference_on_the_packed_weights(fmt, make):
    stored = _experts_stored(5, make)
    experts = _load(Experts(5, 128, 64, 7.0, "e", fmt, Shard()), stored)
    x = torch.randn(6, 128, generator=GEN, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 3], [4, 1], [2, 2], [3, 0], [1, 4], [0, 1]])
    weights = torch.rand(6, 2, generator=GEN)

    def packed(w):  # the stored tensors, stacked: not the layer's parameters
        tensors = [stored[f"e.{i}.{w}"] for i in range(5)]
        stack = {key: torch.stack([t[key] for t in tensors]) for key in tensors[0]}
        scale = stack.get("scale", stack.get("weight_scale"))
        return PackedFp4(stack["weight"], scale, stack.get("weight_scale_2"))

    want = moe_expert_pairs_fp4_reference(x, weights, ids, packed("w1"), packed("w3"), packed("w2"), 7.0)
    assert torch.equal(experts(x, weights, ids), want)


def test_stored_tensors_that_do_not_fit_the_format_are_refused_by_name():
    layer = ColumnParallelLinear(256, [("a.wq_b", 256)], FP8, Shard())
    with pytest.raises(ValueError, match="expected a float8_e4m3fn weight with its scale, found torch.bfloat16"):
        layer.weight_entries().__next__().load({"weight": torch.zeros(256, 256, dtype=torch.bfloat16)})
    with pytest.raises(ValueError, match=r"expected shape \(256, 256\) with scale \(2, 2\), found \(256, 128\)"):
        layer.weight_entries().__next__().load(_fp8(256, 128))
    misaligned = ColumnParallelLinear(256, [("a.wq_b", 256)], FP8, Shard(1, 4))  # 64 rows a rank
    with pytest.raises(ValueError, match=r"rows \[64, 128\) of 256 splits a 128-wide scale block"):
        misaligned.weight_entries().__next__().load(_fp8(256, 256))
    fp32_scales = _fp8(128, 128) | {"scale": torch.tensor([[0.3]])}
    with pytest.raises(ValueError, match="not powers of two need fp32 scales"):
        ColumnParallelLinear(128, [("a.w", 128)], FP8, Shard()).weight_entries().__next__().load(fp32_scales)
    kept = _load(
        ColumnParallelLinear(128, [("a.w", 128)], Fp8BlockScaled(torch.float32), Shard()), {"a.w": fp32_scales}
    )
    assert kept.scale.dtype == torch.float32 and float(kept.scale) == pytest.approx(0.3)  # Flash-Base's fp32 scales
    with pytest.raises(ValueError, match="MXFP4 is a format of the routed experts only"):
        Mxfp4Experts().create(64, 64)
    nvfp4 = Experts(2, 128, 64, 0.0, "e", Nvfp4Experts(), Shard())
    entry = nvfp4.weight_entries().__next__()
    with pytest.raises(ValueError, match="without weight_scale_2, input_scale"):
        entry.load({k: v for k, v in _nvfp4(64, 128).items() if k in ("weight", "weight_scale")})
    with pytest.raises(ValueError, match=r"expected shape \(64, 64\) with weight_scale \(64, 8\)"):
        entry.load(_nvfp4(64, 64))
    with pytest.raises(ValueError, match="weight_scale_2 must be one fp32 value"):
        entry.load(_nvfp4(64, 128) | {"weight_scale_2": torch.ones(2)})


def test_the_checkpoint_config_picks_the_formats():
    official = {"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
                "expert_dtype": "fp4"}  # fmt: skip
    formats = Formats.for_checkpoint(official)
    assert formats.experts == Mxfp4Experts() and formats.linear("layers.3.attn.wo_a") == Fp8BlockScaled()
    assert formats.linear("layers.3.attn.indexer.weights_proj") == Unquantized()  # bf16 in the checkpoint
    assert formats.linear("mtp.0.e_proj") == Fp8BlockScaled()
    base = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}  # Flash-Base
    assert Formats.for_checkpoint(base).dense == Fp8BlockScaled(torch.float32)
    assert Formats.for_checkpoint(base).experts == Unquantized()  # its FP8 experts: dequantized on load
    assert Formats.for_checkpoint(official, "dequantized") == Formats() == Formats.for_checkpoint({})


def _modelopt(layers: dict) -> dict:
    return {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None, "exclude_modules": [],
            "quantized_layers": layers}  # fmt: skip


def test_a_modelopt_mixed_precision_table_makes_its_nvfp4_experts(tmp_path):
    """vLLM's ModelOptMixedPrecisionConfig reads the table from config.json's quantization_config, else from
    hf_quant_config.json's `quantization`; keys name each expert projection (or a layer's experts)."""
    layers = {f"layers.{i}.ffn.experts.{e}.w{w}": {"quant_algo": "NVFP4", "group_size": 16}
              for i in (0, 1) for e in range(4) for w in (1, 2, 3)}  # fmt: skip
    layers |= {"layers.2.ffn.experts": {"quant_algo": "W4A16_NVFP4"}, "layers.0.attn.wq_a": {"quant_algo": "FP8"}}
    table = _modelopt(layers)
    formats = Formats.for_checkpoint({"quantization_config": {"quant_method": "modelopt", **table}})
    assert formats.nvfp4_experts == {"layers.0.ffn.experts", "layers.1.ffn.experts", "layers.2.ffn.experts"}
    assert formats.routed("layers.1.ffn.experts") == Nvfp4Experts()
    assert formats.routed("mtp.0.ffn.experts") == Mxfp4Experts()  # NVIDIA's checkpoint keeps the MTP experts MXFP4
    assert formats.linear("layers.3.attn.wo_a") == Fp8BlockScaled()
    (tmp_path / "config.json").write_text(json.dumps({"expert_dtype": "fp4"}))
    (tmp_path / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt"}, "quantization": table})
    )
    assert Formats.for_model_dir(tmp_path) == formats
    assert Formats.for_model_dir(tmp_path, "dequantized") == Formats()
    with pytest.raises(ValueError, match="only NVFP4 experts are supported"):
        Formats.for_checkpoint({}, hf_quant_config={"quantization": _modelopt({"layers.0.ffn.experts.0.w1": {
            "quant_algo": "FP8"}})})  # fmt: skip
    with pytest.raises(ValueError, match="group_size 32, not 16"):
        Formats.for_checkpoint({}, hf_quant_config={"quantization": _modelopt({"layers.0.ffn.experts.0.w1": {
            "quant_algo": "NVFP4", "group_size": 32}})})  # fmt: skip
    with pytest.raises(ValueError, match="quant_algo 'NVFP4' is not supported: MIXED_PRECISION"):
        Formats.for_checkpoint({"quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}})


def test_the_nvfp4_checkpoint_loads_as_stored_bit_for_bit(nvfp4_dir):
    """make_tiny --layout nvfp4 (convert_official --experts nvfp4): ModelOpt's names and dtypes, the MTP experts
    MXFP4; every stored tensor is held as stored, and nothing else."""
    config = json.loads((nvfp4_dir / "config.json").read_text())
    assert config["quantization_config"]["quant_algo"] == "MIXED_PRECISION"
    model = load_model(nvfp4_dir, dtype=torch.bfloat16)
    stored, held = load_file(nvfp4_dir / "model.safetensors"), checkpoint_tensors(model)
    assert held.keys() == stored.keys()
    w1 = "layers.0.ffn.experts.0.w1"
    assert stored[f"{w1}.weight"].dtype == torch.uint8 and stored[f"{w1}.weight_scale"].dtype == torch.float8_e4m3fn
    assert stored[f"{w1}.weight_scale_2"].shape == () and "mtp.0.ffn.experts.0.w1.scale" in stored
    for name, tensor in stored.items():
        assert torch.equal(_bits(held[name].reshape(tensor.shape)).float(), _bits(tensor).float()), name
    packed = [t for n, t in stored.items() if t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8)]
    assert sum(t.numel() for t in packed) == sum(
        p.numel() for p in model.parameters() if p.dtype in (torch.float8_e4m3fn, torch.int8)
    )  # no dequantized copy beside the codes


def test_the_nvfp4_checkpoint_computes_nearly_the_dequantized_model(nvfp4_dir, official_dir, prompt_ids):
    as_stored = load_with_cache(nvfp4_dir, dtype=torch.float32)
    dequantized = load_with_cache(nvfp4_dir, dtype=torch.float32, weight_formats="dequantized")
    a, b = prefill_logits(as_stored, prompt_ids[:200]), prefill_logits(dequantized, prompt_ids[:200])
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > 0.98  # as the official layout (above)
    mxfp4 = prefill_logits(load_with_cache(official_dir, dtype=torch.float32), prompt_ids[:200])
    # the same bf16 weights quantized two ways: NVFP4's finer scales land at least as close as MXFP4's
    assert torch.nn.functional.cosine_similarity(a, mxfp4, dim=-1).mean() > 0.9


def test_the_engine_serves_the_nvfp4_checkpoint_and_dummy_weights_take_its_formats(nvfp4_dir, prompt_ids, tmp_path):
    llm = LLM(str(nvfp4_dir), dtype="float32")
    ids = prompt_ids[:40].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    first = prefill_logits(load_with_cache(nvfp4_dir, dtype=torch.float32), torch.tensor(ids))[-1].argmax()
    assert len(out.token_ids) == 8 and out.token_ids[0] == int(first)
    (tmp_path / "config.json").write_text((nvfp4_dir / "config.json").read_text())
    model = load_model(tmp_path, dtype=torch.bfloat16, load_format="dummy")
    w1 = model.layers[0].ffn.experts.w1
    assert w1.weight.dtype == torch.int8 and w1.weight_scale.dtype == torch.float8_e4m3fn
    dense = PackedFp4(w1.weight, w1.weight_scale, w1.weight_scale_2).dequantized(torch.arange(2), torch.float32)
    assert 0.5 < float(dense.std() * dense.shape[-1] ** 0.5) < 2  # unit-variance outputs, as plain weights
    with pytest.raises(ValueError, match="weight_formats must be one of"):
        EngineConfig(model="m", weight_formats="fp8")


def test_the_official_checkpoint_loads_as_stored_bit_for_bit(official_dir):
    model = load_model(official_dir, dtype=torch.bfloat16)
    stored, held = load_file(official_dir / "model.safetensors"), checkpoint_tensors(model)
    assert held.keys() == stored.keys()
    for name, tensor in stored.items():
        if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8):
            assert held[name].dtype == tensor.dtype and torch.equal(_bits(held[name]), _bits(tensor)), name
        else:  # norms and compressor weights: the model keeps them in fp32, the values as stored
            assert torch.equal(held[name].float(), tensor.float()), name
    quantized = [t for t in stored.values() if t.dtype in (torch.float8_e4m3fn, torch.int8)]
    assert sum(t.numel() for t in quantized) == sum(
        p.numel() for p in model.parameters() if p.dtype in (torch.float8_e4m3fn, torch.int8)
    )  # no dequantized copy beside the codes


def test_the_official_checkpoint_as_stored_computes_nearly_the_dequantized_model(official_dir, prompt_ids):
    as_stored = load_with_cache(official_dir, dtype=torch.float32)
    dequantized = load_with_cache(official_dir, dtype=torch.float32, weight_formats="dequantized")
    a, b = prefill_logits(as_stored, prompt_ids[:200]), prefill_logits(dequantized, prompt_ids[:200])
    # The same weights; only the activations' per-128 FP8 rounding before each FP8 linear differs, as the official
    # inference rounds them and the dequantized model (as transformers) does not.
    assert torch.nn.functional.cosine_similarity(a, b, dim=-1).mean() > 0.98


def test_dummy_weights_are_made_in_the_checkpoint_formats(official_dir, tmp_path):
    (tmp_path / "config.json").write_text((official_dir / "config.json").read_text())
    model = load_model(tmp_path, dtype=torch.bfloat16, load_format="dummy")
    wq_b, w1 = model.layers[0].attn.qr_proj.parts[0], model.layers[0].ffn.experts.w1
    assert wq_b.weight.dtype == torch.float8_e4m3fn and w1.weight.dtype == torch.int8
    scale = e8m0_to_float(wq_b.scale)
    assert torch.equal(scale, torch.exp2(torch.log2(scale).round()))  # powers of two
    weight = wq_b.fmt.linear(wq_b.params(), torch.eye(wq_b.in_features))  # the weight's columns, as the layer sees it
    assert 0.5 < float(weight.float().std() * wq_b.in_features**0.5) < 2  # unit-variance outputs, as plain weights


def test_the_engine_serves_the_official_checkpoint_from_its_stored_formats(official_dir, prompt_ids, tmp_path):
    llm = LLM(str(official_dir), dtype="float32")
    assert llm.engine.applied_config.weight_formats == "as_stored"
    ids = prompt_ids[:40].tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(out.token_ids) == 8
    first = prefill_logits(load_with_cache(official_dir, dtype=torch.float32), torch.tensor(ids))[-1].argmax()
    assert out.token_ids[0] == int(first)
    ckpt = tmp_path / "bf16-where-fp8"
    shutil.copytree(official_dir, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["layers.0.attn.wq_a.weight"] = tensors["layers.0.attn.wq_a.weight"].to(torch.bfloat16)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"wq_a\.weight.*expected a float8_e4m3fn weight"):
        load_model(ckpt, dtype=torch.float32)
