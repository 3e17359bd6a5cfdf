"""Weight formats: how a linear or expert layer stores its weight, loads it from a checkpoint and multiplies by it.
This is the one file where a new format plugs in (FP8 block-scaled linears and MXFP4/NVFP4 experts come next).

A layer asks its format for its parameters (`create`, named as the checkpoint names a member's tensors: `weight`,
`scale`, ...), hands it each member's stored tensors (`load`), and calls it to compute x·Wᵀ (`linear`,
`grouped_linear`, `expert_pairs`). A parallel layer loads only its rank's part of a member: a `Region` of the full
weight in weight elements (rows for a column-parallel layer, columns for a row-parallel one, the whole of it when
replicated), which the format maps onto each stored tensor (a block-scaled format's scales cover 128x128 blocks, a
packed FP4 byte two columns). The loader never converts a tensor itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.moe import moe_expert_pairs
from engine.kernels.quant import dequantize_fp4_weight, dequantize_fp8_weight

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
                     limit: float, touched: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """The routed experts' clamped SwiGLU, each (token, pick) pair a row [N * k, D] weighted by its routing
        weight; `touched` counts the distinct experts read."""
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

    def expert_pairs(self, w1, w3, w2, x, weights, ids, limit, touched):
        return moe_expert_pairs(x, weights, ids, w1["weight"], w3["weight"], w2["weight"], limit, touched)


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


@dataclass(frozen=True)
class Formats:
    """Which format the model's weight-owning layers keep: dense linears by checkpoint name, the routed experts."""

    dense: WeightFormat = Unquantized()
    experts: WeightFormat = Unquantized()

    def linear(self, name: str) -> WeightFormat:
        return self.dense
