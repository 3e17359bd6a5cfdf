"""The DeepSeek-V4 transformer (reference §3): embed, expand to hc residual streams, blocks of attention and MoE
wrapped in hyper-connections, collapse, norm, head. Optional MTP layers predict one token further."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.cache.kv_cache import ModelKVCache
from engine.model.args import ModelArgs
from engine.model.attention import Attention
from engine.model.layers import RMSNorm
from engine.model.linear import Layout, ReplicatedLinear
from engine.model.mhc import HcMix, HyperConnection, HyperHead
from engine.model.moe import MoE
from engine.model.state import ForwardBatch
from engine.model.weight_formats import Formats

# Parameters the reference keeps in fp32 whatever the model dtype: mixing weights, sinks, position biases,
# routing biases, norm weights. (The compressors' projections are pinned to fp32 by their weight format.)
FP32_PARAMETERS = re.compile(r"(hc_\w+\.|hc_head\.|attn_sink|\.ape$|gate\.bias|norm\.weight)")


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool, formats: Formats, layout: Layout):
        super().__init__()
        hc_args = (args.hc_mult, args.hidden_size, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc_args)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer_id, quant_sim, formats, layout)
        self.hc_ffn = HyperConnection(*hc_args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(args, layer_id, formats, layout)

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, next_fn: torch.Tensor, mix: HcMix | None = None
    ) -> tuple[torch.Tensor, HcMix]:
        """streams [N, hc, D] (and their mixes with hc_attn.fn when the previous block made them) -> the new streams
        and their mixes with `next_fn`, the weights of the hc_pre or hc_head that reads them next. Each hc_post
        makes the next mixes in the same pass (hc_post_mix)."""
        x, post, comb = self.hc_attn.pre(streams, mix)
        out = self.attn(self.attn_norm(x), batch)
        streams, mix = HyperConnection.post_mix(out, streams, post, comb, self.hc_ffn.fn)
        x, post, comb = self.hc_ffn.pre(streams, mix)
        return HyperConnection.post_mix(
            self.ffn(self.ffn_norm(x), batch.input_ids, batch.moe_rows), streams, post, comb, next_fn
        )


class MTPLayer(Block):
    """Multi-token prediction (§7): from the main model's streams at t and the token at t+1, predict t+2."""

    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool, formats: Formats, layout: Layout):
        super().__init__(args, layer_id, quant_sim, formats, layout)
        dim, prefix = args.hidden_size, args.block_name(layer_id)
        self.enorm = RMSNorm(dim, args.rms_norm_eps)
        self.hnorm = RMSNorm(dim, args.rms_norm_eps)
        self.e_proj, self.h_proj = (ReplicatedLinear(dim, [(name, dim)], formats.linear(name))
                                    for name in (f"{prefix}.e_proj", f"{prefix}.h_proj"))  # fmt: skip
        self.hc_head = HyperHead(args.hc_mult, dim, args.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def predict(self, streams: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds))[:, None, :]
        return self.norm(self.hc_head(*self.forward(x, batch, self.hc_head.fn)))


class DeepseekV4(nn.Module):
    """`formats`: how the weight-owning layers store their weights (default: plain, in the model's dtype);
    `layout`: how they are split over ranks (default: one GPU holds everything)."""

    def __init__(self, args: ModelArgs, quant_sim: bool = True, formats: Formats | None = None,
                 layout: Layout | None = None):  # fmt: skip
        super().__init__()
        formats, layout = formats or Formats(), layout or Layout()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i, quant_sim, formats, layout) for i in range(args.num_hidden_layers))
        self.hc_head = HyperHead(args.hc_mult, args.hidden_size, args.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = ReplicatedLinear(args.hidden_size, [("head", args.vocab_size)], formats.linear("head"))
        n = args.num_hidden_layers
        self.mtp = nn.ModuleList(
            MTPLayer(args, n + j, quant_sim, formats, layout) for j in range(args.num_nextn_predict_layers)
        )

    def cast(self, dtype: torch.dtype) -> DeepseekV4:
        """Cast to `dtype`, leaving the parameters the reference keeps in fp32 and those whose weight format keeps
        its own dtype."""
        kept = {id(p) for m in self.modules() if hasattr(m, "fmt") and not m.fmt.follows_model_dtype
                for p in m.parameters()}  # fmt: skip
        for name, param in self.named_parameters():
            if id(param) not in kept and not FP32_PARAMETERS.search(name):
                param.data = param.data.to(dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def bind_kv_cache(self, cache: ModelKVCache) -> None:
        """Give every layer its share of the paged cache that boot allocated (the model allocates none itself)."""
        for block, layer_kv in zip([*self.layers, *self.mtp], cache.layers, strict=True):
            block.attn.kv = layer_kv

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch's tokens through every layer; returns the residual streams [N, hc, D] and advances each
        request's state. The batch holds its device-side tables (ForwardBatch.set_tables)."""
        streams = self.run_layers(batch)
        self.advance(batch)
        return streams

    def run_layers(self, batch: ForwardBatch) -> torch.Tensor:
        """The device's part: embed, every block, the residual streams [N, hc, D]. A decode batch runs without a
        host sync or a data-dependent shape, so it can be captured in a CUDA graph (engine/cuda_graphs.py)."""
        h = self.embed(batch.input_ids)
        streams = h[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()
        mix = None  # the embedding's streams: the first hc_pre makes their mixes itself
        # The last block's mixes (with hc_head's weights) are dropped: logits() takes any rows of the streams (a
        # prefill's last ones), so hc_head makes its own.
        next_fns = [*(layer.hc_attn.fn for layer in self.layers[1:]), self.hc_head.fn]
        for layer, next_fn in zip(self.layers, next_fns, strict=True):
            streams, mix = layer(streams, batch, next_fn, mix)
        return streams

    @staticmethod
    def advance(batch: ForwardBatch) -> None:
        for seq, n in zip(batch.states, batch.lens, strict=True):
            seq.num_tokens += n

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """[M, hc, D] streams -> [M, vocab] fp32 logits."""
        return self.head(self.norm(self.hc_head(streams))).float()

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the token after `next_ids` from the first MTP layer, for the batch's positions."""
        if not self.mtp:
            raise ValueError("this checkpoint has no MTP layer")
        return self.head(self.mtp[0].predict(streams, self.embed(next_ids), batch)).float()
