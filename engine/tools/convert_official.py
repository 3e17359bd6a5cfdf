"""`python -m engine.tools.convert_official --src DIR --out DIR`: rewrite a checkpoint in the official DeepSeek-V4
layout (reference §10): FP8 e4m3 linears with 128x128 ue8m0 scales, routed experts as packed FP4 (e2m1) with
per-32 ue8m0 scales, everything else in the official dtypes."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.kernels.quant import quantize_fp4_weight, quantize_fp8_weight
from engine.logging import configure_logging
from engine.model.loader import load_model
from engine.model.weight_formats import OFFICIAL_FP8_MEMBERS
from engine.model.weights import checkpoint_tensors

FP8_LINEARS = re.compile(OFFICIAL_FP8_MEMBERS.removesuffix("$") + r"\.weight$")
FP4_EXPERTS = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
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


def official_tensors(model) -> dict[str, torch.Tensor]:
    tensors = {}
    for name, tensor in checkpoint_tensors(model).items():
        if FP4_EXPERTS.search(name):
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp4_weight(tensor)
        elif FP8_LINEARS.search(name):
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp8_weight(tensor)
        elif tensor.dtype in (torch.int64, torch.int32):
            tensors[name] = tensor
        else:
            tensors[name] = tensor.to(torch.float32 if FP32_TENSORS.search(name) else torch.bfloat16)
    return tensors


def convert(src: Path, out: Path) -> Path:
    model = load_model(src, dtype=torch.float32, weight_formats="dequantized")
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in official_tensors(model).items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config |= OFFICIAL_FORMATS
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, required=True, help="checkpoint to read (any supported layout)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the official-layout checkpoint")
    args = parser.parse_args()
    configure_logging()
    convert(args.src, args.out)
    print(f"official-layout checkpoint written to {args.out}")


if __name__ == "__main__":
    main()
