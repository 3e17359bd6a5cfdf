"""Weight formats: how a linear or expert layer stores its weight, loads it from a checkpoint and multiplies by it.
This is the one file where a new format plugs in: `Unquantized` (plain floats), `Fp8BlockScaled` (the official
checkpoint's dense linears, kept e4m3 with their 128x128 scales), `Mxfp4Experts` (its routed experts, kept as packed
e2m1 with a ue8m0 scale per 32 values) and `Nvfp4Experts` (NVIDIA ModelOpt's routed experts: packed e2m1 with an e4m3
scale per 16 values and a global fp32 scale). `Formats.for_checkpoint` picks them from a checkpoint's config.

A layer asks its format for its parameters (`create`, named as the checkpoint names a member's tensors: `weight`,
`scale`, ...), hands it each member's stored tensors (`load`), and calls it to compute x·Wᵀ (`linear`,
`grouped_linear`, `expert_pairs`). A parallel layer loads only its rank's part of a member: a `Region` of the full
weight in weight elements (rows for a column-parallel layer, columns for a row-parallel one, the whole of it when
replicated), which the format maps onto each stored tensor (a block-scaled format's scales cover 128x128 blocks, a
packed FP4 byte two columns). The loader never converts a tensor itself.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.dispatch import at_gemm_rows
from engine.kernels.fp4_moe import MX_BLOCK, PackedFp4, moe_expert_pairs_fp4
from engine.kernels.fp8_gemm import BLOCK as FP8_BLOCK
from engine.kernels.fp8_gemm import fp8_block_grouped_linear, fp8_block_linear
from engine.kernels.moe import moe_expert_pairs
from engine.kernels.quant import (
    NVFP4_BLOCK,
    dequantize_fp4_weight,
    dequantize_fp8_weight,
    dequantize_nvfp4_weight,
    e8m0_to_float,
)
from engine.model.checkpoint_names import canonical_name

PLAIN_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class Region:
    """Rows [row, row + rows) and columns [col, col + cols) of a member's full weight, in weight elements."""

    row: int
    rows: int
    col: int
    cols: int

    @staticmethod
    def whole(rows: int, cols: int) -> Region:
        return Region(0, rows, 0, cols)


class WeightFormat:
    """The interface every format implements. `params` below are a layer's parameters by their stored name."""

    #: the parameters take the model's dtype (`DeepseekV4.cast` casts them); a pinned or quantized format keeps its own
    follows_model_dtype: bool = True
    #: weight rows that share a scale: a merged layer stacks a member after another only on such a boundary
    row_block: int = 1

    def create(self, rows: int, cols: int, experts: int | None = None) -> dict[str, nn.Parameter]:
        """Parameters for a [rows, cols] weight (this rank's part, members stacked along rows), or for `experts`
        such weights stacked in front."""
        raise NotImplementedError

    def load(self, params: dict[str, torch.Tensor], stored: dict[str, torch.Tensor], full: tuple[int, int],
             src: Region, dst_row: int) -> None:  # fmt: skip
        """Copy region `src` of one member's stored tensors (its full weight is `full`) into `params` from weight
        row `dst_row` on. Raises ValueError when the stored tensors do not fit `full`."""
        raise NotImplementedError

    def stored(self, params: dict[str, torch.Tensor], row: int, rows: int) -> dict[str, torch.Tensor]:
        """A member's tensors as a checkpoint stores them (weight rows [row, row + rows) of the parameters): what
        the checkpoint tools write, for a layer that holds the whole weight."""
        raise NotImplementedError

    def linear(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [..., cols] -> [..., rows] in x's dtype."""
        raise NotImplementedError

    def grouped_linear(self, params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """x [N, G, cols / G] -> [N, G, rows / G]: group g multiplies by rows [g R, (g + 1) R) of the weight, on
        its own slice of the input (DeepSeek-V4's grouped low-rank output projection)."""
        raise NotImplementedError

    def expert_pairs(self, w1: dict, w3: dict, w2: dict, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                     limit: float, touched: torch.Tensor | None, remote: bool = False) -> torch.Tensor:  # fmt: skip
        """The routed experts' clamped SwiGLU, each (token, pick) pair a row [N * k, D] weighted by its routing
        weight; `touched` counts the distinct experts read. An id equal to the expert count is another rank's
        expert (`remote`: some may be): a zero row."""
        raise NotImplementedError


@dataclass(frozen=True)
class Unquantized(WeightFormat):
    """A plain float weight `weight` [rows, cols] in the model's dtype. `product`: the dtype the product comes out in
    when wider than the model's: the compressors' projections keep their bf16 weights, as the checkpoint stores
    them, and run in fp32, as the reference runs them (for bf16 inputs a bf16 GEMM that sums and returns fp32 is
    that product, on the tensor cores). A checkpoint that stores the member in FP8 (with its block scale) or as
    packed FP4 is dequantized here, on load, to the model's dtype."""

    product: torch.dtype | None = None

    def create(self, rows, cols, experts=None):
        shape = (rows, cols) if experts is None else (experts, rows, cols)
        return {"weight": nn.Parameter(torch.zeros(shape), requires_grad=False)}

    def load(self, params, stored, full, src, dst_row):
        weight = _plain_weight(stored)
        if tuple(weight.shape) != full:
            raise ValueError(f"expected shape {full}, found {tuple(weight.shape)}")
        part = weight[src.row : src.row + src.rows, src.col : src.col + src.cols]
        params["weight"][dst_row : dst_row + src.rows].copy_(part)

    def stored(self, params, row, rows):
        return {"weight": params["weight"][row : row + rows]}

    def linear(self, params, x):
        weight = params["weight"]
        # A float64 model (tests) runs its fp32 products in float64, so results do not depend on chunking.
        out = x.dtype if self.product is None else torch.promote_types(x.dtype, self.product)
        if out == x.dtype:
            return at_gemm_rows(lambda rows: F.linear(rows, weight), x)
        if x.is_cuda and x.dim() == 2:
            return at_gemm_rows(lambda rows: torch.mm(rows, weight.T, out_dtype=out), x)
        return at_gemm_rows(lambda rows: F.linear(rows.to(out), weight.to(out)), x)

    def grouped_linear(self, params, x):
        weight = params["weight"].view(x.shape[1], -1, x.shape[2]).to(x.dtype)
        return at_gemm_rows(lambda rows: torch.einsum("ngd,grd->ngr", rows, weight), x)

    def expert_pairs(self, w1, w3, w2, x, weights, ids, limit, touched, remote=False):
        return moe_expert_pairs(x, weights, ids, w1["weight"], w3["weight"], w2["weight"], limit, touched, remote)


@dataclass(frozen=True)
class Fp8BlockScaled(WeightFormat):
    """The official checkpoint's dense linears, kept as stored: `weight` e4m3 [rows, cols] and `scale` [ceil(rows /
    128), ceil(cols / 128)], ue8m0 as the official checkpoint ships it or fp32 as Flash-Base does (`scale_dtype`).
    x·Wᵀ quantizes the activations per token and 128 channels and promotes the fp32 sum every 128 values of K
    (engine/kernels/fp8_gemm.py). A rank's part starts and ends on 128-blocks, so its scales are whole blocks."""

    scale_dtype: torch.dtype = torch.float8_e8m0fnu
    follows_model_dtype = False
    row_block = FP8_BLOCK

    def create(self, rows, cols, experts=None):
        if experts is not None:
            raise ValueError(
                "FP8 routed experts are not supported: serve them dequantized (--weight-formats dequantized)"
            )
        blocks = (math.ceil(rows / FP8_BLOCK), math.ceil(cols / FP8_BLOCK))
        return {
            "weight": nn.Parameter(torch.zeros(rows, cols, dtype=torch.float8_e4m3fn), requires_grad=False),
            "scale": nn.Parameter(torch.ones(blocks).to(self.scale_dtype), requires_grad=False),
        }

    def load(self, params, stored, full, src, dst_row):
        weight, scale = stored["weight"], stored.get("scale")
        if weight.dtype != torch.float8_e4m3fn or scale is None:
            raise ValueError(f"expected a float8_e4m3fn weight with its scale, found {weight.dtype}"
                             + ("" if scale is not None else " without a scale"))  # fmt: skip
        blocks = (math.ceil(full[0] / FP8_BLOCK), math.ceil(full[1] / FP8_BLOCK))
        if tuple(weight.shape) != full or tuple(scale.shape) != blocks:
            raise ValueError(f"expected shape {full} with scale {blocks}, found {tuple(weight.shape)} with scale "
                             f"{tuple(scale.shape)}")  # fmt: skip
        rows, cols = _blocks(src.row, src.rows, full[0], "rows"), _blocks(src.col, src.cols, full[1], "columns")
        if dst_row % FP8_BLOCK:
            raise ValueError(f"a member stacked at row {dst_row} splits a 128-row scale block")
        params["weight"][dst_row : dst_row + src.rows].copy_(weight[src.row : src.row + src.rows,
                                                                    src.col : src.col + src.cols])  # fmt: skip
        first = dst_row // FP8_BLOCK
        params["scale"][first : first + rows.stop - rows.start].copy_(_scale_as(scale[rows, cols], self.scale_dtype))

    def stored(self, params, row, rows):
        blocks = slice(row // FP8_BLOCK, math.ceil((row + rows) / FP8_BLOCK))
        return {"weight": params["weight"][row : row + rows], "scale": params["scale"][blocks]}

    def linear(self, params, x):
        y = fp8_block_linear(x.reshape(-1, x.shape[-1]), params["weight"], params["scale"])
        return y.view(*x.shape[:-1], y.shape[-1])

    def grouped_linear(self, params, x):
        return fp8_block_grouped_linear(x, params["weight"], params["scale"])


def _blocks(start: int, length: int, full: int, what: str) -> slice:
    """The 128-blocks of a rank's part [start, start + length) of `full` weight rows or columns."""
    end = start + length
    if start % FP8_BLOCK or (end % FP8_BLOCK and end != full):
        raise ValueError(f"a part of {what} [{start}, {end}) of {full} splits a 128-wide scale block")
    return slice(start // FP8_BLOCK, math.ceil(end / FP8_BLOCK))


def _scale_as(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A stored block scale in the parameter's dtype; fp32 into ue8m0 only when every value is a power of two."""
    if scale.dtype == dtype:
        return scale
    if scale.dtype not in (torch.float8_e8m0fnu, torch.float32):
        raise ValueError(f"unsupported scale dtype {scale.dtype}")
    values = e8m0_to_float(scale)
    if dtype == torch.float8_e8m0fnu and not torch.equal(e8m0_to_float(values.to(dtype)), values):
        raise ValueError(
            "fp32 block scales that are not powers of two need fp32 scales (Fp8BlockScaled(torch.float32))"
        )
    return values.to(dtype)


@dataclass(frozen=True)
class Mxfp4Experts(WeightFormat):
    """The official checkpoint's routed experts, kept as stored: `weight` packed e2m1 pairs [experts, rows, cols / 2]
    (int8, the low nibble the even element) and `scale` ue8m0 [experts, rows, cols / 32]. The grouped GEMM upcasts
    the codes to the activations' dtype in registers (W4A16, engine/kernels/fp4_moe.py says why)."""

    follows_model_dtype = False

    def create(self, rows, cols, experts=None):
        if experts is None:
            raise ValueError("MXFP4 is a format of the routed experts only")
        if cols % MX_BLOCK:
            raise ValueError(f"MXFP4 experts need input features a multiple of {MX_BLOCK}, not {cols}")
        return {
            "weight": nn.Parameter(torch.zeros(experts, rows, cols // 2, dtype=torch.int8), requires_grad=False),
            "scale": nn.Parameter(torch.ones(experts, rows, cols // MX_BLOCK).to(torch.float8_e8m0fnu),
                                  requires_grad=False),
        }  # fmt: skip

    def load(self, params, stored, full, src, dst_row):
        weight, scale = stored["weight"], stored.get("scale")
        if weight.dtype not in (torch.int8, torch.uint8) or scale is None:
            raise ValueError(f"expected packed e2m1 codes (int8) with their scale, found {weight.dtype}"
                             + ("" if scale is not None else " without a scale"))  # fmt: skip
        packed, blocks = (full[0], full[1] // 2), (full[0], full[1] // MX_BLOCK)
        if tuple(weight.shape) != packed or tuple(scale.shape) != blocks:
            raise ValueError(f"expected shape {packed} with scale {blocks}, found {tuple(weight.shape)} with scale "
                             f"{tuple(scale.shape)}")  # fmt: skip
        if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise ValueError(f"unsupported scale dtype {scale.dtype} (ue8m0 expected)")
        params["weight"].copy_(weight.view(torch.int8))
        params["scale"].copy_(scale.view(torch.float8_e8m0fnu))

    def stored(self, params, row, rows):
        return {"weight": params["weight"][row : row + rows], "scale": params["scale"][row : row + rows]}

    def expert_pairs(self, w1, w3, w2, x, weights, ids, limit, touched, remote=False):
        w1, w3, w2 = (PackedFp4(w["weight"], w["scale"]) for w in (w1, w3, w2))
        return moe_expert_pairs_fp4(x, weights, ids, w1, w3, w2, limit, touched, remote)


@dataclass(frozen=True)
class Nvfp4Experts(WeightFormat):
    """Routed experts as NVIDIA's ModelOpt checkpoints store them (docs/quantized-weights.md cites the names): per
    expert and projection `weight` packed e2m1 pairs [rows, cols / 2] (uint8, low nibble the even element),
    `weight_scale` e4m3 [rows, cols / 16], `weight_scale_2` the fp32 global scale and `input_scale` the activations'
    calibrated fp32 scale, kept as stored (a W4A4 kernel's; the W4A16 grouped GEMM, engine/kernels/fp4_moe.py, keeps
    the activations in bf16 and does not read it)."""

    follows_model_dtype = False

    def create(self, rows, cols, experts=None):
        if experts is None:
            raise ValueError("NVFP4 is a format of the routed experts only")
        if cols % MX_BLOCK:  # the grouped GEMM's K tiles are whole 32-value blocks
            raise ValueError(f"NVFP4 experts need input features a multiple of {MX_BLOCK}, not {cols}")

        def param(*shape, dtype):
            return nn.Parameter(torch.zeros(experts, *shape, dtype=dtype), requires_grad=False)

        return {
            "weight": param(rows, cols // 2, dtype=torch.int8),
            "weight_scale": param(rows, cols // NVFP4_BLOCK, dtype=torch.float8_e4m3fn),
            "weight_scale_2": param(dtype=torch.float32),
            "input_scale": param(dtype=torch.float32),
        }

    def load(self, params, stored, full, src, dst_row):
        names = ("weight", "weight_scale", "weight_scale_2", "input_scale")
        missing = [name for name in names if name not in stored]
        if missing or stored["weight"].dtype not in (torch.int8, torch.uint8):
            lacking = f" without {', '.join(missing)}" if missing else ""
            raise ValueError("expected NVFP4 tensors (uint8 codes, weight_scale, weight_scale_2, input_scale), found "
                             f"{stored['weight'].dtype} codes{lacking}")  # fmt: skip
        weight, scale = stored["weight"], stored["weight_scale"]
        packed, blocks = (full[0], full[1] // 2), (full[0], full[1] // NVFP4_BLOCK)
        if tuple(weight.shape) != packed or tuple(scale.shape) != blocks:
            raise ValueError(f"expected shape {packed} with weight_scale {blocks}, found {tuple(weight.shape)} with "
                             f"weight_scale {tuple(scale.shape)}")  # fmt: skip
        if scale.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise ValueError(f"unsupported weight_scale dtype {scale.dtype} (e4m3 expected)")
        for name in ("weight_scale_2", "input_scale"):
            if stored[name].numel() != 1:
                raise ValueError(f"{name} must be one fp32 value, found shape {tuple(stored[name].shape)}")
            params[name].copy_(stored[name].reshape(()).float())
        params["weight"].copy_(weight.view(torch.int8))
        params["weight_scale"].copy_(scale.view(torch.float8_e4m3fn))

    def stored(self, params, row, rows):
        return {"weight": params["weight"][row : row + rows], "weight_scale": params["weight_scale"][row : row + rows],
                "weight_scale_2": params["weight_scale_2"], "input_scale": params["input_scale"]}  # fmt: skip

    def expert_pairs(self, w1, w3, w2, x, weights, ids, limit, touched, remote=False):
        w1, w3, w2 = (PackedFp4(w["weight"], w["weight_scale"], w["weight_scale_2"]) for w in (w1, w3, w2))
        return moe_expert_pairs_fp4(x, weights, ids, w1, w3, w2, limit, touched, remote)


def _plain_weight(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The member's weight as floats: as stored, or dequantized from FP8 e4m3 / packed e2m1 with its scales."""
    weight = stored["weight"]
    if weight.dtype in PLAIN_DTYPES:
        return weight
    if weight.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        raise ValueError(f"unsupported dtype {weight.dtype}")
    if "weight_scale_2" in stored:
        return dequantize_nvfp4_weight(weight, stored["weight_scale"].view(torch.float8_e4m3fn),
                                       stored["weight_scale_2"].float().reshape(()))  # fmt: skip
    if "scale" not in stored:
        raise ValueError(f"a {weight.dtype} weight needs its scale tensor")
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_weight(weight, stored["scale"])
    return dequantize_fp4_weight(weight, stored["scale"])


#: the dense linears the official checkpoint stores in FP8 (reference §9), by member name
OFFICIAL_FP8_MEMBERS = r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj)$"
#: how weights are held: as the checkpoint stores them, or dequantized to the model's dtype
WEIGHT_FORMATS = ("as_stored", "dequantized")


#: ModelOpt's per-layer algorithms (quantized_layers) that are NVFP4 weights; W4A16_NVFP4 stores the same tensors
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
_EXPERT_MEMBER = re.compile(r"^(.+\.ffn\.experts)(\.\d+\.w[123])?$")


@dataclass(frozen=True)
class Formats:
    """Which format the model's weight-owning layers keep: `dense` for the dense linears whose checkpoint name
    matches `dense_members` (all of them when None; the others stay plain), `experts` for the routed experts, except
    the layers' experts named in `nvfp4_experts` (their prefix, `layers.3.ffn.experts`), which are NVFP4."""

    dense: WeightFormat = Unquantized()
    experts: WeightFormat = Unquantized()
    dense_members: str | None = None
    nvfp4_experts: frozenset[str] = frozenset()

    def linear(self, name: str) -> WeightFormat:
        if self.dense_members is None or re.search(self.dense_members, name):
            return self.dense
        return Unquantized()

    def routed(self, prefix: str) -> WeightFormat:
        """The format of the routed experts `{prefix}.{e}.w1` ..."""
        return Nvfp4Experts() if prefix in self.nvfp4_experts else self.experts

    def describe(self) -> dict[str, str]:
        """The formats in words, for the boot log."""
        described = {"dense_linears": type(self.dense).__name__, "routed_experts": type(self.experts).__name__}
        if self.nvfp4_experts:
            described["nvfp4_expert_layers"] = str(len(self.nvfp4_experts))
        return described

    @staticmethod
    def for_model_dir(model_dir: str | Path, weight_formats: str = "as_stored") -> Formats:
        """`for_checkpoint` on a checkpoint directory's config.json and, when there is one, ModelOpt's
        hf_quant_config.json."""
        model_dir = Path(model_dir)
        legacy = model_dir / "hf_quant_config.json"
        return Formats.for_checkpoint(json.loads((model_dir / "config.json").read_text()), weight_formats,
                                      json.loads(legacy.read_text()) if legacy.exists() else None)  # fmt: skip

    @staticmethod
    def for_checkpoint(config: dict, weight_formats: str = "as_stored", hf_quant_config: dict | None = None) -> Formats:
        """The formats a checkpoint declares: the official layout's config.json (`quantization_config` FP8 with
        128x128 blocks, `expert_dtype` fp4), or a ModelOpt MIXED_PRECISION table (config.json's
        `quantization_config` with quant_method modelopt, else hf_quant_config.json's `quantization`) whose NVFP4
        routed experts are `Nvfp4Experts` and whose other modules keep the official formats; plain weights when
        `weight_formats` is "dequantized"."""
        if weight_formats not in WEIGHT_FORMATS:
            raise ValueError(f"weight_formats must be one of {WEIGHT_FORMATS}, not {weight_formats!r}")
        quant = config.get("quantization_config") or {}
        modelopt = quant if quant.get("quant_method") == "modelopt" else (hf_quant_config or {}).get("quantization")
        if weight_formats == "dequantized" or (quant.get("quant_method") != "fp8" and not modelopt):
            return Formats()
        if modelopt:
            return Formats(Fp8BlockScaled(), Mxfp4Experts(), OFFICIAL_FP8_MEMBERS, _nvfp4_experts(modelopt))
        if list(quant.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"FP8 weight_block_size {quant['weight_block_size']} is not supported (128x128 only)")
        scale_dtype = torch.float8_e8m0fnu if quant.get("scale_fmt") == "ue8m0" else torch.float32
        experts = Mxfp4Experts() if config.get("expert_dtype") == "fp4" else Unquantized()
        return Formats(Fp8BlockScaled(scale_dtype), experts, OFFICIAL_FP8_MEMBERS)


def _nvfp4_experts(modelopt: dict) -> frozenset[str]:
    """The routed-expert prefixes a ModelOpt quantization table gives NVFP4 (its keys name a layer's experts or
    each expert's projection, by official name). The quantized_layers table of vLLM's
    ModelOptMixedPrecisionConfig; a bare NVFP4 quant_algo makes no table and is refused."""
    if modelopt.get("quant_algo") != "MIXED_PRECISION" or not modelopt.get("quantized_layers"):
        raise ValueError(
            f"ModelOpt quant_algo {modelopt.get('quant_algo')!r} is not supported: MIXED_PRECISION "
            "with a quantized_layers table (NVFP4 routed experts, the rest in the official formats) is"
        )
    prefixes = set()
    for key, layer in modelopt["quantized_layers"].items():
        match = _EXPERT_MEMBER.match(canonical_name(f"{key}.weight").removesuffix(".weight"))
        algo = str(layer.get("quant_algo", "")).upper()
        if match is None:
            continue  # a dense module: the official FP8 block format, checked tensor by tensor on load
        if algo not in NVFP4_ALGOS:
            raise ValueError(f"routed experts {key} in {algo}: only NVFP4 experts are supported")
        if layer.get("group_size", NVFP4_BLOCK) != NVFP4_BLOCK:
            raise ValueError(f"routed experts {key}: NVFP4 group_size {layer['group_size']}, not {NVFP4_BLOCK}")
        prefixes.add(match.group(1))
    return frozenset(prefixes)
