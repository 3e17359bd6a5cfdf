"""Load a DeepSeek-V4 checkpoint (Hugging Face or official layout, bf16/fp32 or FP8 + packed FP4) into the
engine's model, dequantising on load. Errors name the tensor; progress is reported as it goes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from engine.kernels.quant import dequantize_fp4_weight, dequantize_fp8_weight
from engine.model.args import ModelArgs
from engine.model.checkpoint_names import canonical_name, internal_to_official, official_to_hf, routed_expert_part
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.random_init import randomize

log = structlog.get_logger(__name__)

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
Progress = Callable[[int, int], None]


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded as this model; the message names the tensor."""


class _Shards:
    """Where each tensor lives, by official name; tensors are read lazily, one at a time."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {model_dir}")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where: dict[str, tuple[int, str]] = {}
        for i, handle in enumerate(self.handles):
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self.where[canonical_name(key)] = (i, key)
        self.files = files

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def describe(self, name: str) -> str:
        i, key = self.where[name]
        return f"{key} in {self.files[i].name}"

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (official), dequantised to fp32 when stored as FP8 or packed FP4."""
        if name not in self.where:
            raise CheckpointError(f"checkpoint lacks tensor {name} (Hugging Face name {official_to_hf(name)})")
        i, key = self.where[name]
        tensor = self.handles[i].get_tensor(key)
        if tensor.dtype in PLAIN_DTYPES or tensor.dtype in INDEX_DTYPES:
            return tensor
        scale_name = name.removesuffix("weight") + "scale"
        if tensor.dtype not in (torch.float8_e4m3fn, torch.int8):
            raise CheckpointError(f"tensor {self.describe(name)} has unsupported dtype {tensor.dtype}")
        if scale_name not in self.where:
            raise CheckpointError(f"quantised tensor {self.describe(name)} has no scale tensor {scale_name}")
        scale = self.handles[self.where[scale_name][0]].get_tensor(self.where[scale_name][1])
        try:
            if tensor.dtype == torch.float8_e4m3fn:
                return dequantize_fp8_weight(tensor, scale)
            return dequantize_fp4_weight(tensor, scale)
        except ValueError as exc:
            raise CheckpointError(f"tensor {self.describe(name)}: {exc}") from exc


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quant_sim: bool = True,
    progress: Progress | None = None,
    load_format: str = "auto",
) -> DeepseekV4:
    """`load_format` "dummy": the directory's config.json with seeded random weights made on `device`."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_model_dir(model_dir)
    if load_format == "dummy":
        # Made in `dtype` from the start (those kept in fp32 say so themselves): at V4-Flash widths an fp32 model
        # would not fit beside the bf16 one.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = randomize(DeepseekV4(args, quant_sim=quant_sim), seed=0).cast(dtype)
        finally:
            torch.set_default_dtype(default_dtype)
        log.info("weights_loaded", model=str(model_dir), load_format="dummy")
        return model.eval()
    shards = _Shards(model_dir)
    if args.num_nextn_predict_layers and not any(name.startswith("mtp.") for name in shards.where):
        # transformers drops MTP tensors when it saves; such a checkpoint serves without MTP.
        log.info("mtp_absent", model=str(model_dir))
        args = dataclasses.replace(
            args, num_nextn_predict_layers=0, compress_ratios=args.compress_ratios[: args.num_hidden_layers]
        )
    with torch.device(device):
        model = DeepseekV4(args, quant_sim=quant_sim).cast(dtype)
    targets = dict(model.named_parameters()) | {n: b for n, b in model.named_buffers() if n.endswith("tid2eid")}
    started, total = time.monotonic(), len(targets)
    with torch.no_grad():
        for done, (name, target) in enumerate(targets.items(), start=1):
            tensor = _read_internal(shards, name, args)
            if tuple(tensor.shape) != tuple(target.shape):
                official = internal_to_official(name)
                where = shards.describe(official) if official in shards else official
                raise CheckpointError(
                    f"tensor {where}: expected shape {tuple(target.shape)}, found {tuple(tensor.shape)}"
                )
            target.copy_(tensor.to(target.dtype))
            if progress is not None:
                progress(done, total)
            if done * 10 // total != (done - 1) * 10 // total:  # every tenth of the tensors
                log.info("load_progress", tensors_loaded=done, tensors_total=total)
    log.info("weights_loaded", model=str(model_dir), tensors=total, seconds=round(time.monotonic() - started, 3))
    return model.eval()


def _read_internal(shards: _Shards, name: str, args: ModelArgs) -> torch.Tensor:
    """One engine parameter from the checkpoint: routed experts are stacked from per-expert tensors (official)
    or split from the fused gate_up projection (Hugging Face)."""
    official = internal_to_official(name)
    expert = routed_expert_part(official)
    if expert is None:
        return shards.read(official)
    prefix, part = expert
    if f"{prefix}.experts.down_proj" in shards:
        if part == "w2":
            return shards.read(f"{prefix}.experts.down_proj")
        gate_up = shards.read(f"{prefix}.experts.gate_up_proj")
        inter = args.moe_intermediate_size
        return gate_up[:, :inter] if part == "w1" else gate_up[:, inter:]
    return torch.stack([shards.read(f"{prefix}.experts.{e}.{part}.weight") for e in range(args.n_routed_experts)])
