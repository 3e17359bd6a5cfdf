"""Linear layers that own their weights (as nano-vllm's layers/linear.py): replicated, column-parallel (output rows
split over the ranks) and row-parallel (input columns split, outputs summed over the ranks). Each stores its weight
in a `WeightFormat` (engine/model/weight_formats.py) and loads, from the checkpoint, only the part its rank holds.

A layer may merge several *members*, projections that read the same input, into one GEMM: its weight is their rows
stacked, its output their columns (`split` per member). Members keep their own checkpoint names, so merging is a
property of the layer, not a rewrite of weights after loading. `ProjectionGroup` merges what can be merged: members
of one format and one way of splitting.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from engine.distributed import all_reduce
from engine.model.weight_formats import Region, WeightFormat
from engine.model.weights import WeightEntry


@dataclass(frozen=True)
class Shard:
    """A rank's place in the group a layer's weights are split over."""

    rank: int = 0
    size: int = 1

    def part(self, n: int, what: str) -> tuple[int, int]:
        """(start, length) of this rank's equal share of n."""
        if n % self.size:
            raise ValueError(f"{what}: {n} does not split evenly over {self.size} ranks")
        length = n // self.size
        return self.rank * length, length


class Linear(nn.Module):
    """y = x·Wᵀ over `members`: (checkpoint name, output features) pairs, without bias. Subclasses say how the
    weight is split (`region`)."""

    def __init__(self, in_features: int, members: Sequence[tuple[str, int]], fmt: WeightFormat, shard: Shard = Shard()):
        super().__init__()
        self.fmt, self.shard, self.in_features = fmt, shard, in_features
        self.names = [name for name, _ in members]
        self.full = [(rows, in_features) for _, rows in members]
        self.regions = [self.region(rows, in_features, name) for name, rows in members]
        self.sizes = [r.rows for r in self.regions]
        for name, param in fmt.create(sum(self.sizes), self.regions[0].cols).items():
            self.register_parameter(name, param)

    def region(self, rows: int, cols: int, name: str) -> Region:
        raise NotImplementedError

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.named_parameters(recurse=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fmt.linear(self.params(), x)

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's output, column slices of the one product."""
        return list(self(x).split(self.sizes, dim=-1))

    def weight_entries(self) -> Iterator[WeightEntry]:
        params, offset = self.params(), 0
        for name, full, region in zip(self.names, self.full, self.regions, strict=True):
            load = partial(self.fmt.load, params, full=full, src=region, dst_row=offset)
            yield WeightEntry(name, lambda stored, load=load: load(stored=stored),
                              partial(self.fmt.stored, params, offset, region.rows))  # fmt: skip
            offset += region.rows


class ReplicatedLinear(Linear):
    """Every rank holds the whole weight."""

    def region(self, rows, cols, name):
        return Region.whole(rows, cols)


class ColumnParallelLinear(Linear):
    """Each rank holds 1/size of every member's output rows and computes those output features."""

    def region(self, rows, cols, name):
        start, length = self.shard.part(rows, f"{name} output features")
        return Region(start, length, 0, cols)


class GroupedColumnLinear(ColumnParallelLinear):
    """DeepSeek-V4's grouped low-rank output projection `wo_a`: G groups, group g maps its own slice of the input
    (one group of heads) through rows [g R, (g + 1) R) of the weight. Split by whole groups."""

    def __init__(self, groups: int, in_per_group: int, out_per_group: int, name: str, fmt: WeightFormat,
                 shard: Shard = Shard()):  # fmt: skip
        shard.part(groups, f"{name} groups")
        super().__init__(in_per_group, [(name, groups * out_per_group)], fmt, shard)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, G_local, in_per_group] -> [N, G_local, out_per_group]."""
        return self.fmt.grouped_linear(self.params(), x)


class RowParallelLinear(Linear):
    """Each rank holds 1/size of the input columns, multiplies its slice of the input, and the partial outputs are
    summed over the group — unless `reduce` is False: the caller adds more partial sums first and reduces once."""

    def __init__(self, in_features: int, members: Sequence[tuple[str, int]], fmt: WeightFormat, shard: Shard = Shard(),
                 reduce: bool = True):  # fmt: skip
        super().__init__(in_features, members, fmt, shard)
        self.reduce = reduce

    def region(self, rows, cols, name):
        start, length = self.shard.part(cols, f"{name} input features")
        return Region(0, rows, start, length)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fmt.linear(self.params(), x)
        if self.reduce and self.shard.size > 1:
            all_reduce(y)
        return y


class ProjectionGroup(nn.Module):
    """Projections of one input computed as few GEMMs as their formats and splits allow: members that share both
    are one merged linear, except that nothing stacks after a member whose rows end inside one of its format's
    scale blocks (a small test model's). `members`: (checkpoint name, output features, format, split over the
    shard?)."""

    def __init__(self, in_features: int, members: Sequence[tuple[str, int, WeightFormat, bool]], shard: Shard):
        super().__init__()
        groups: list[tuple[WeightFormat, bool, list[tuple[str, int]]]] = []
        open_groups: dict[tuple[WeightFormat, bool], list[tuple[str, int]]] = {}
        for name, rows, fmt, split in members:
            split = split and shard.size > 1
            if (fmt, split) not in open_groups:
                open_groups[fmt, split] = []
                groups.append((fmt, split, open_groups[fmt, split]))
            open_groups[fmt, split].append((name, rows))
            if (rows // shard.size if split else rows) % fmt.row_block:  # ends mid-block: nothing stacks after it
                del open_groups[fmt, split]
        self.parts = nn.ModuleList(
            (ColumnParallelLinear if split else ReplicatedLinear)(in_features, group, fmt, shard)
            for fmt, split, group in groups
        )
        where = {name: (i, j) for i, part in enumerate(self.parts) for j, name in enumerate(part.names)}
        self.order = [where[name] for name, *_ in members]

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Each member's output, in the order the members were given."""
        outs = [part.split(x) for part in self.parts]
        return [outs[i][j] for i, j in self.order]


@dataclass(frozen=True)
class Layout:
    """How the model's layers are split over the ranks of one host. Embedding and head are replicated: every rank
    makes full logits, as grammar masks and sampling need them."""

    attention: Shard = Shard()  # dense attention weights and the shared expert (size 1 when attention is replicated)
    experts: Shard = Shard()  # the routed experts, a range per rank
    # Each rank runs its own requests through replicated attention; the MoE gathers every rank's tokens for the
    # experts and hands each rank back its own rows.
    data_parallel: bool = False

    @classmethod
    def for_rank(cls, attention: str, rank: int, size: int) -> Layout:
        """The layout of `rank` of `size` with attention "data-parallel" or "tensor-parallel" (EngineConfig)."""
        if size == 1:
            return cls()
        split = Shard(rank, size)
        if attention == "tensor-parallel":
            return cls(attention=split, experts=split)
        return cls(experts=split, data_parallel=True)
