"""`python -m engine.tools.convert_official --src DIR --out DIR [--experts nvfp4]`: rewrite a checkpoint in the
official DeepSeek-V4 layout (reference §10): FP8 e4m3 linears with 128x128 ue8m0 scales, routed experts as packed FP4
(e2m1) with per-32 ue8m0 scales (MXFP4), everything else in the official dtypes. `--experts nvfp4` writes the main
layers' routed experts as NVIDIA's ModelOpt checkpoint of V4-Flash does instead (NVFP4: `weight`, `weight_scale`,
`weight_scale_2`, `input_scale`; the MTP layers' experts stay MXFP4) with its MIXED_PRECISION table in config.json
(docs/quantized-weights.md). The writer has no calibration data: `input_scale`, which only a W4A4 kernel reads, is
written as 1."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.kernels.quant import NVFP4_BLOCK, quantize_fp4_weight, quantize_fp8_weight, quantize_nvfp4_weight
from engine.logging import configure_logging
from engine.model.loader import load_model
from engine.model.weight_formats import OFFICIAL_FP8_MEMBERS
from engine.model.weights import checkpoint_tensors

FP8_LINEARS = re.compile(OFFICIAL_FP8_MEMBERS.removesuffix("$") + r"\.weight$")
FP4_EXPERTS = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
EXPERT_LAYOUTS = ("mxfp4", "nvfp4")
FP32_TENSORS = re.compile(r"(hc_\w+|attn_sink|gate\.bias|\.ape)$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# config.json's keys that declare the official formats, as the official checkpoint's config.json has them
OFFICIAL_FORMATS = {
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
    "expert_dtype": "fp4",
}


def official_tensors(model, experts: str = "mxfp4") -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in checkpoint_tensors(model).items():
        member = name.removesuffix("weight")
        if FP4_EXPERTS.search(name) and experts == "nvfp4" and name.startswith("layers."):
            codes, scale, global_scale = quantize_nvfp4_weight(tensor)
            tensors |= {name: codes.view(torch.uint8), member + "weight_scale": scale,
                        member + "weight_scale_2": global_scale, member + "input_scale": torch.ones(())}  # fmt: skip
        elif FP4_EXPERTS.search(name):
            tensors[name], tensors[member + "scale"] = quantize_fp4_weight(tensor)
        elif FP8_LINEARS.search(name):
            tensors[name], tensors[member + "scale"] = quantize_fp8_weight(tensor)
        elif tensor.dtype in (torch.int64, torch.int32):
            tensors[name] = tensor
        else:
            tensors[name] = tensor.to(torch.float32 if FP32_TENSORS.search(name) else torch.bfloat16)
    return tensors


def modelopt_quantization(tensors: dict[str, torch.Tensor]) -> dict:
    """ModelOpt's MIXED_PRECISION table for these tensors: each NVFP4 expert projection, each FP8 linear."""
    layers = {}
    for name in tensors:
        if name.endswith(".weight_scale_2"):
            layers[name.removesuffix(".weight_scale_2")] = {"quant_algo": "NVFP4", "group_size": NVFP4_BLOCK}
        elif FP8_LINEARS.search(name):
            layers[name.removesuffix(".weight")] = {"quant_algo": "FP8"}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
            "exclude_modules": [], "quantized_layers": layers}  # fmt: skip


def convert(src: Path, out: Path, experts: str = "mxfp4") -> Path:
    if experts not in EXPERT_LAYOUTS:
        raise ValueError(f"experts must be one of {EXPERT_LAYOUTS}, not {experts!r}")
    model = load_model(src, dtype=torch.float32, weight_formats="dequantized")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in official_tensors(model, experts).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config |= OFFICIAL_FORMATS
    if experts == "nvfp4":
        config["quantization_config"] = modelopt_quantization(tensors)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="checkpoint to read (any supported layout)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the official-layout checkpoint")
    parser.add_argument("--experts", choices=EXPERT_LAYOUTS, default="mxfp4",
                        help="the routed experts' format: the official MXFP4, or ModelOpt's NVFP4")  # fmt: skip
    args = parser.parse_args()
    configure_logging()
    convert(args.src, args.out, args.experts)
    print(f"official-layout checkpoint written to {args.out}")


if __name__ == "__main__":
    main()
