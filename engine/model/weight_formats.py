"""Weight formats: how a linear or expert layer stores its weight, loads it from a checkpoint and multiplies by it.
This is the one file where a new format plugs in: `Unquantized` (plain floats), `Fp8BlockScaled` (the official
checkpoint's dense linears, kept e4m3 with their 128x128 scales) and `Mxfp4Experts` (its routed experts, kept as packed
e2m1 with a ue8m0 scale per 32 values). `Formats.for_checkpoint` picks them from a checkpoint's config.

A layer asks its format for its parameters (`create`, named as the checkpoint names a member's tensors: `weight`,
`scale`, ...), hands it each member's stored tensors (`load`), and calls it to compute x·Wᵀ (`linear`,
`grouped_linear`, `expert_pairs`). A parallel layer loads only its rank's part of a member: a `Region` of the full
weight in weight elements (rows for a column-parallel layer, columns for a row-parallel one, the whole of it when
replicated), which the format maps onto each stored tensor (a block-scaled format's scales cover 128x128 blocks, a
packed FP4 byte two columns). The loader never converts a tensor itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.fp8_gemm import BLOCK as FP8_BLOCK
from engine.kernels.fp8_gemm import fp8_block_grouped_linear, fp8_block_linear
from engine.kernels.moe import moe_expert_pairs
from engine.kernels.mxfp4_moe import MX_BLOCK, moe_expert_pairs_mxfp4
from engine.kernels.quant import dequantize_fp4_weight, dequantize_fp8_weight, e8m0_to_float

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
    """A plain float weight `weight` [rows, cols]: the model's dtype, or `dtype` when pinned (the compressors'
    projections stay fp32, as the reference runs them). A checkpoint that stores the member in FP8 (with its block
    scale) or as packed FP4 is dequantized here, on load, to that dtype."""

    dtype: torch.dtype | None = None

    @property
    def follows_model_dtype(self) -> bool:
        return self.dtype is None

    def create(self, rows, cols, experts=None):
        shape = (rows, cols) if experts is None else (experts, rows, cols)
        return {"weight": nn.Parameter(torch.zeros(shape, dtype=self.dtype), requires_grad=False)}

    def load(self, params, stored, full, src, dst_row):
        weight = _plain_weight(stored)
        if tuple(weight.shape) != full:
            raise ValueError(f"expected shape {full}, found {tuple(weight.shape)}")
        part = weight[src.row : src.row + src.rows, src.col : src.col + src.cols]
        params["weight"][dst_row : dst_row + src.rows].copy_(part)

    def stored(self, params, row, rows):
        return {"weight": params["weight"][row : row + rows]}

    def linear(self, params, x):
        # A float64 model (tests) runs its fp32 projections in float64 too, so results do not depend on chunking.
        return F.linear(x, params["weight"].to(x.dtype))

    def grouped_linear(self, params, x):
        weight = params["weight"].view(x.shape[1], -1, x.shape[2])
        return torch.einsum("ngd,grd->ngr", x, weight.to(x.dtype))

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
    the codes to the activations' dtype in registers (W4A16, engine/kernels/mxfp4_moe.py says why)."""

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
        return moe_expert_pairs_mxfp4(x, weights, ids, w1["weight"], w1["scale"], w3["weight"], w3["scale"],
                                      w2["weight"], w2["scale"], limit, touched, remote)  # fmt: skip


def _plain_weight(stored: dict[str, torch.Tensor]) -> torch.Tensor:
    """The member's weight as floats: as stored, or dequantized from FP8 e4m3 / packed e2m1 with its `scale`."""
    weight = stored["weight"]
    if weight.dtype in PLAIN_DTYPES:
        return weight
    if weight.dtype not in (torch.float8_e4m3fn, torch.int8, torch.uint8):
        raise ValueError(f"unsupported dtype {weight.dtype}")
    if "scale" not in stored:
        raise ValueError(f"a {weight.dtype} weight needs its scale tensor")
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8_weight(weight, stored["scale"])
    return dequantize_fp4_weight(weight, stored["scale"])


#: the dense linears the official checkpoint stores in FP8 (reference §9), by member name
OFFICIAL_FP8_MEMBERS = r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|shared_experts\.w[123]|e_proj|h_proj)$"
#: how weights are held: as the checkpoint stores them, or dequantized to the model's dtype
WEIGHT_FORMATS = ("as_stored", "dequantized")


@dataclass(frozen=True)
class Formats:
    """Which format the model's weight-owning layers keep: `dense` for the dense linears whose checkpoint name
    matches `dense_members` (all of them when None; the others stay plain), `experts` for the routed experts."""

    dense: WeightFormat = Unquantized()
    experts: WeightFormat = Unquantized()
    dense_members: str | None = None

    def linear(self, name: str) -> WeightFormat:
        if self.dense_members is None or re.search(self.dense_members, name):
            return self.dense
        return Unquantized()

    def describe(self) -> dict[str, str]:
        """The formats in words, for the boot log."""
        return {"dense_linears": type(self.dense).__name__, "routed_experts": type(self.experts).__name__}

    @staticmethod
    def for_checkpoint(config: dict, weight_formats: str = "as_stored") -> Formats:
        """The formats a checkpoint's config.json declares (the official layout: `quantization_config` FP8 with
        128x128 blocks, `expert_dtype` fp4), or plain weights when `weight_formats` is "dequantized"."""
        if weight_formats not in WEIGHT_FORMATS:
            raise ValueError(f"weight_formats must be one of {WEIGHT_FORMATS}, not {weight_formats!r}")
        quant = config.get("quantization_config") or {}
        if weight_formats == "dequantized" or quant.get("quant_method") != "fp8":
            return Formats()
        if list(quant.get("weight_block_size", [FP8_BLOCK, FP8_BLOCK])) != [FP8_BLOCK, FP8_BLOCK]:
            raise ValueError(f"FP8 weight_block_size {quant['weight_block_size']} is not supported (128x128 only)")
        scale_dtype = torch.float8_e8m0fnu if quant.get("scale_fmt") == "ue8m0" else torch.float32
        experts = Mxfp4Experts() if config.get("expert_dtype") == "fp4" else Unquantized()
        return Formats(Fp8BlockScaled(scale_dtype), experts, OFFICIAL_FP8_MEMBERS)
