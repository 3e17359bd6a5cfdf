"""Layers that own their weights: merged projections keep each member's checkpoint name and output, a rank loads
only its part (the parts at world size 2 and 4 put back together are the whole weight), and the loader hands the
stored tensors to the layer's weight format."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.quant import dequantize_fp8_weight, quantize_fp8_weight
from engine.model.args import ModelArgs
from engine.model.deepseek_v4 import DeepseekV4
from engine.model.linear import (
    ColumnParallelLinear,
    GroupedColumnLinear,
    Layout,
    ProjectionGroup,
    ReplicatedLinear,
    RowParallelLinear,
    Shard,
)
from engine.model.moe import Experts
from engine.model.weight_formats import Formats, Unquantized
from engine.model.weights import checkpoint_tensors, plain_tensors, weight_entries
from engine.tools.make_tiny import TINY_CONFIG

GEN = torch.Generator().manual_seed(3)


def _load(layer, stored: dict[str, dict[str, torch.Tensor]]):
    for entry in layer.weight_entries():
        entry.load(stored[entry.name])
    return layer


def _full(*shape):
    return {"weight": torch.randn(*shape, generator=GEN)}


@pytest.mark.parametrize("size", [2, 4])
def test_column_row_and_grouped_shards_put_back_together_are_the_whole_weight(size):
    members = {"a.wq_b": _full(64, 32), "a.indexer.wq_b": _full(32, 32)}
    out = {"a.wo_b": _full(24, 64)}
    grouped = {"a.wo_a": _full(8 * 16, 12)}  # 8 groups of 16 rows
    columns, rows, groups = [], [], []
    for rank in range(size):
        shard = Shard(rank, size)
        layer = ColumnParallelLinear(32, [("a.wq_b", 64), ("a.indexer.wq_b", 32)], Unquantized(), shard)
        columns.append(_load(layer, members).weight.split(layer.sizes))
        rows.append(_load(RowParallelLinear(64, [("a.wo_b", 24)], Unquantized(), shard), out).weight)
        groups.append(_load(GroupedColumnLinear(8, 12, 16, "a.wo_a", Unquantized(), shard), grouped).weight)
    # each rank holds its slice of every member, members stacked along the rows
    assert torch.equal(torch.cat([c[0] for c in columns]), members["a.wq_b"]["weight"])
    assert torch.equal(torch.cat([c[1] for c in columns]), members["a.indexer.wq_b"]["weight"])
    assert torch.equal(torch.cat(rows, dim=1), out["a.wo_b"]["weight"])
    assert torch.equal(torch.cat(groups), grouped["a.wo_a"]["weight"])
    with pytest.raises(ValueError, match="a.wo_b input features: 64 does not split evenly over 3 ranks"):
        RowParallelLinear(64, [("a.wo_b", 24)], Unquantized(), Shard(0, 3))


@pytest.mark.parametrize("size", [2, 4])
def test_row_parallel_partial_products_sum_to_the_whole_product(size):
    stored = {"w": _full(24, 64)}
    x = torch.randn(5, 64, generator=GEN)
    whole = _load(ReplicatedLinear(64, [("w", 24)], Unquantized()), stored)(x)
    partial = []
    for rank in range(size):
        layer = _load(RowParallelLinear(64, [("w", 24)], Unquantized(), Shard(rank, size)), stored)
        start, length = Shard(rank, size).part(64, "w")
        partial.append(layer.fmt.linear(layer.params(), x[:, start : start + length]))  # what all_reduce sums
    torch.testing.assert_close(sum(partial), whole)


@pytest.mark.parametrize("size", [2, 4])
def test_experts_hold_a_range_and_load_only_theirs(size):
    stored = {
        f"f.experts.{e}.{w}": _full(*((6, 8) if w != "w2" else (8, 6))) for e in range(8) for w in ("w1", "w2", "w3")
    }
    parts = []
    for rank in range(size):
        experts = Experts(8, 8, 6, 10.0, "f.experts", Unquantized(), Shard(rank, size))
        names = [entry.name for entry in experts.weight_entries()]
        assert names[0] == f"f.experts.{rank * 8 // size}.w1" and len(names) == 3 * 8 // size
        parts.append(_load(experts, stored).w1.weight)
    assert torch.equal(torch.cat(parts), torch.stack([stored[f"f.experts.{e}.w1"]["weight"] for e in range(8)]))


def test_a_projection_group_merges_members_of_one_format_and_keeps_their_order():
    x = torch.randn(3, 16, generator=GEN)
    stored = {"p.a": _full(8, 16), "p.b": _full(4, 16), "p.c": _full(2, 16)}
    plain = [(name, len(tensors["weight"]), Unquantized(), False) for name, tensors in stored.items()]
    one = _load_group(ProjectionGroup(16, plain, Shard()), stored)
    assert len(one.parts) == 1 and one.parts[0].weight.shape == (14, 16)
    wide = Unquantized(product=torch.float64)
    mixed = ProjectionGroup(16, [("p.a", 8, Unquantized(), False), ("p.b", 4, wide, False),
                                 ("p.c", 2, Unquantized(), False)], Shard())  # fmt: skip
    _load_group(mixed, stored)
    assert [part.names for part in mixed.parts] == [["p.a", "p.c"], ["p.b"]]
    for group in (one, mixed):
        outs = group(x)
        for out, name in zip(outs, ("p.a", "p.b", "p.c"), strict=True):
            torch.testing.assert_close(out.float(), x @ stored[name]["weight"].T)


def _load_group(group, stored):
    for part in group.parts:
        _load(part, stored)
    return group


def test_the_model_names_its_tensors_as_the_checkpoint_does():
    """Merged projections have no checkpoint name of their own; every member and plain tensor has exactly one."""
    model = DeepseekV4(ModelArgs.from_config(TINY_CONFIG))
    attn = model.layers[2].attn  # c4: wq_a, wkv and the indexer's weights_proj merged; four fp32 compressor members
    assert attn.x_proj.parts[0].names == [
        "layers.2.attn.wq_a",
        "layers.2.attn.wkv",
        "layers.2.attn.indexer.weights_proj",
    ]
    assert attn.qr_proj.parts[0].names == ["layers.2.attn.wq_b", "layers.2.attn.indexer.wq_b"]
    assert attn.x_fp32_proj.parts[0].weight.dtype == torch.float32
    names = [entry.name for entry in weight_entries(model)]
    assert len(names) == len(set(names)) and "mtp.0.e_proj" in names and "layers.5.ffn.experts.7.w2" in names
    tensors = checkpoint_tensors(model)
    assert "layers.0.hc_attn_fn" in plain_tensors(model) and "layers.0.ffn.gate.tid2eid" in tensors
    stored = sum(t.numel() for t in tensors.values() if t.dtype != torch.int64)
    assert stored == sum(p.numel() for p in model.parameters())  # each parameter element under exactly one name
    model.cast(torch.bfloat16)  # the compressors' weights too (bf16 in the checkpoint); their products stay fp32
    assert attn.x_fp32_proj.parts[0].weight.dtype == attn.x_proj.parts[0].weight.dtype == torch.bfloat16
    x = torch.randn(3, TINY_CONFIG["hidden_size"], generator=GEN).bfloat16()
    assert all(out.dtype == torch.float32 for out in attn.x_fp32_proj(x))


def test_an_unquantized_format_dequantizes_an_fp8_member_it_is_given():
    weight = torch.randn(256, 192, generator=GEN)
    codes, scale = quantize_fp8_weight(weight)
    layer = ColumnParallelLinear(192, [("w", 256)], Unquantized(), Shard(1, 2))
    _load(layer, {"w": {"weight": codes, "scale": scale}})
    assert torch.equal(layer.weight, dequantize_fp8_weight(codes, scale)[128:])
    with pytest.raises(ValueError, match="needs its scale tensor"):
        _load(layer, {"w": {"weight": codes}})
    with pytest.raises(ValueError, match=r"expected shape \(256, 192\), found \(128, 192\)"):
        _load(layer, {"w": {"weight": weight[:128]}})


def test_a_layout_splits_the_model_heads_and_experts():
    """The model built for rank 1 of 2 holds half the heads' query rows and half the experts."""
    args = ModelArgs.from_config(TINY_CONFIG)
    model = DeepseekV4(args, formats=Formats(), layout=Layout(Shard(1, 2), Shard(1, 2)))
    attn = model.layers[2].attn
    assert [part.names for part in attn.qr_proj.parts] == [["layers.2.attn.wq_b"], ["layers.2.attn.indexer.wq_b"]]
    assert attn.qr_proj.parts[0].weight.shape[0] == args.num_attention_heads * args.head_dim // 2
    assert model.layers[2].ffn.experts.first == 4 and model.layers[2].ffn.experts.w1.weight.shape[0] == 4
