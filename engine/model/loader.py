"""Load a DeepSeek-V4 checkpoint (Hugging Face or official layout, bf16/fp32 or FP8 + packed FP4) into the
engine's model: the checkpoint's names map to the layers' weight entries (engine/model/weights.py), whose weight
formats take the tensors as stored. Errors name the tensor; progress is reported as it goes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from engine.model.args import ModelArgs
from engine.model.checkpoint_names import canonical_name, official_to_hf
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.linear import Layout
from engine.model.random_init import randomize
from engine.model.weight_formats import Formats
from engine.model.weights import WeightEntry, plain_tensors, weight_entries

log = structlog.get_logger(__name__)

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)
Progress = Callable[[int, int], None]
# Hugging Face stacks the routed experts of a layer ([E, 2I, D] gate and up, [E, D, I] down); the reader presents
# them per expert under the official names.
STACKED_EXPERTS = {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}
QUANT_SIDECARS = ("scale", "weight_scale", "weight_scale_2", "input_scale")


class CheckpointError(ValueError):
    """The checkpoint cannot be loaded as this model; the message names the tensor."""


class _Shards:
    """Where each tensor lives, by official name; tensors are read lazily, one at a time, as stored."""

    def __init__(self, model_dir: Path):
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {model_dir}")
        self.handles = [safe_open(str(f), framework="pt") for f in files]
        self.where: dict[str, tuple[int, str]] = {}
        # official per-expert name -> (stacked tensor's official name, expert, which of its parts, parts)
        self.stacked: dict[str, tuple[str, int, int, int]] = {}
        for i, handle in enumerate(self.handles):
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                name = canonical_name(key)
                self.where[name] = (i, key)
                prefix, _, leaf = name.rpartition(".experts.")
                if leaf in STACKED_EXPERTS:
                    parts = STACKED_EXPERTS[leaf]
                    for e in range(handle.get_slice(key).get_shape()[0]):
                        for j, w in enumerate(parts):
                            self.stacked[f"{prefix}.experts.{e}.{w}.weight"] = (name, e, j, len(parts))
        self.files = files

    def __contains__(self, name: str) -> bool:
        return name in self.where or name in self.stacked

    def describe(self, name: str) -> str:
        if name in self.stacked:
            stacked, e, *_ = self.stacked[name]
            return f"expert {e} of {self.describe(stacked)}"
        i, key = self.where[name]
        return f"{key} in {self.files[i].name}"

    def read(self, name: str) -> torch.Tensor:
        """The tensor `name` (official) as stored."""
        if name in self.stacked:
            stacked, e, j, parts = self.stacked[name]
            i, key = self.where[stacked]
            whole = self.handles[i].get_slice(key)[e]
            return whole.chunk(parts, dim=0)[j]
        if name not in self.where:
            raise CheckpointError(f"checkpoint lacks tensor {name} (Hugging Face name {official_to_hf(name)})")
        i, key = self.where[name]
        return self.handles[i].get_tensor(key)

    def member(self, prefix: str) -> dict[str, torch.Tensor]:
        """A layer member's stored tensors by suffix: `weight` and, when quantized, its sidecars (the official
        `scale`; ModelOpt NVFP4's `weight_scale`, `weight_scale_2` and `input_scale`)."""
        stored = {"weight": self.read(f"{prefix}.weight")}
        for sidecar in QUANT_SIDECARS:
            if f"{prefix}.{sidecar}" in self:
                stored[sidecar] = self.read(f"{prefix}.{sidecar}")
        return stored


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    quant_sim: bool = True,
    progress: Progress | None = None,
    load_format: str = "auto",
    weight_formats: str = "as_stored",
    layout: Layout | None = None,
) -> DeepseekV4:
    """`load_format` "dummy": the directory's config.json with seeded random weights made on `device`. Otherwise
    each layer's members are handed to the layer's weight format as stored, and every other tensor is copied into
    its parameter (cast to the parameter's dtype). `weight_formats`: keep the formats the checkpoint declares (FP8
    dense linears, MXFP4 or NVFP4 experts) or hold every weight dequantized in `dtype` (Formats.for_checkpoint).
    `layout`: the rank's part of the model, of which only its share of each tensor is kept."""
    model_dir = Path(model_dir)
    args = ModelArgs.from_model_dir(model_dir)
    formats = Formats.for_model_dir(model_dir, weight_formats)
    if load_format == "dummy":
        # Made in `dtype` from the start (those kept in fp32 say so themselves): at V4-Flash widths an fp32 model
        # would not fit beside the bf16 one.
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = randomize(DeepseekV4(args, quant_sim=quant_sim, formats=formats, layout=layout),
                                  seed=0).cast(dtype)  # fmt: skip
        finally:
            torch.set_default_dtype(default_dtype)
        log.info("weights_loaded", model=str(model_dir), load_format="dummy", formats=formats.describe())
        return model.eval()
    shards = _Shards(model_dir)
    if args.num_nextn_predict_layers and not any(name.startswith("mtp.") for name in shards.where):
        # transformers drops MTP tensors when it saves; such a checkpoint serves without MTP.
        log.info("mtp_absent", model=str(model_dir))
        args = dataclasses.replace(
            args, num_nextn_predict_layers=0, compress_ratios=args.compress_ratios[: args.num_hidden_layers]
        )
    with torch.device(device):
        model = DeepseekV4(args, quant_sim=quant_sim, formats=formats, layout=layout).cast(dtype)
    entries, plain = list(weight_entries(model)), plain_tensors(model)
    started, total = time.monotonic(), len(entries) + len(plain)
    with torch.no_grad():
        for done, load in enumerate(_loads(shards, entries, plain), start=1):
            load()
            if progress is not None:
                progress(done, total)
            if done * 10 // total != (done - 1) * 10 // total:  # every tenth of the tensors
                log.info("load_progress", tensors_loaded=done, tensors_total=total)
    log.info(
        "weights_loaded",
        model=str(model_dir),
        formats=formats.describe(),
        tensors=total,
        seconds=round(time.monotonic() - started, 3),
    )
    return model.eval()


def _loads(shards: _Shards, entries: list[WeightEntry], plain: dict[str, torch.Tensor]):
    """A load for each layer member and plain tensor; a load's error names the stored tensor."""

    def member(entry: WeightEntry):
        stored = shards.member(entry.name)
        try:
            entry.load(stored)
        except ValueError as exc:
            raise CheckpointError(f"tensor {shards.describe(entry.name + '.weight')}: {exc}") from exc

    def copy(name: str, target: torch.Tensor):
        tensor = shards.read(name)
        if tensor.dtype not in PLAIN_DTYPES + INDEX_DTYPES:
            raise CheckpointError(f"tensor {shards.describe(name)} has unsupported dtype {tensor.dtype}")
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor {shards.describe(name)}: expected shape {tuple(target.shape)}, found {tuple(tensor.shape)}"
            )
        target.copy_(tensor.to(target.dtype))

    for entry in entries:
        yield lambda entry=entry: member(entry)
    for name, target in plain.items():
        yield lambda name=name, target=target: copy(name, target)
