"""The DeepSeek-V4 transformer (reference §3): embed, expand to hc residual streams, blocks of attention and MoE
wrapped in hyper-connections, collapse, norm, head. Optional MTP layers predict one token further."""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.model.args import ModelArgs
from engine.model.attention import Attention
from engine.model.layers import RMSNorm
from engine.model.mhc import HyperConnection, HyperHead
from engine.model.moe import MoE
from engine.model.state import CompressorState, ForwardBatch, LayerState, SequenceState

# Parameters the reference keeps in fp32 whatever the model dtype: mixing weights, sinks, position biases,
# routing biases, norm weights, and the compressors' projections (pooled in fp32).
FP32_PARAMETERS = re.compile(r"(hc_\w+\.|hc_head\.|attn_sink|\.ape$|gate\.bias|norm\.weight|compressor\.w(kv|gate))")


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool):
        super().__init__()
        hc_args = (args.hc_mult, args.hidden_size, args.hc_sinkhorn_iters, args.hc_eps, args.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc_args)
        self.attn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = Attention(args, layer_id, quant_sim)
        self.hc_ffn = HyperConnection(*hc_args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.ffn = MoE(args, layer_id)

    def forward(self, streams: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, post, comb = self.hc_attn.pre(streams)
        streams = HyperConnection.post(self.attn(self.attn_norm(x), batch), streams, post, comb)
        x, post, comb = self.hc_ffn.pre(streams)
        return HyperConnection.post(self.ffn(self.ffn_norm(x), batch.input_ids), streams, post, comb)


class MTPLayer(Block):
    """Multi-token prediction (§7): from the main model's streams at t and the token at t+1, predict t+2."""

    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool):
        super().__init__(args, layer_id, quant_sim)
        dim = args.hidden_size
        self.enorm = RMSNorm(dim, args.rms_norm_eps)
        self.hnorm = RMSNorm(dim, args.rms_norm_eps)
        self.e_proj = nn.Linear(dim, dim, bias=False)
        self.h_proj = nn.Linear(dim, dim, bias=False)
        self.hc_head = HyperHead(args.hc_mult, dim, args.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def predict(self, streams: torch.Tensor, next_embeds: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x = self.h_proj(self.hnorm(streams)) + self.e_proj(self.enorm(next_embeds))[:, None, :]
        return self.norm(self.hc_head(self.forward(x, batch)))


class DeepseekV4(nn.Module):
    def __init__(self, args: ModelArgs, quant_sim: bool = True):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(Block(args, i, quant_sim) for i in range(args.num_hidden_layers))
        self.hc_head = HyperHead(args.hc_mult, args.hidden_size, args.hc_eps, args.rms_norm_eps)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        n = args.num_hidden_layers
        self.mtp = nn.ModuleList(MTPLayer(args, n + j, quant_sim) for j in range(args.num_nextn_predict_layers))

    def cast(self, dtype: torch.dtype) -> DeepseekV4:
        """Cast to `dtype`, leaving the parameters the reference keeps in fp32."""
        for name, param in self.named_parameters():
            if not FP32_PARAMETERS.search(name):
                param.data = param.data.to(dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_state(self) -> SequenceState:
        args, device, dtype = self.args, self.embed.weight.device, self.dtype
        layers = []
        for ratio in args.compress_ratios:
            layer = LayerState(window=torch.empty(0, args.head_dim, device=device, dtype=dtype))
            if ratio:
                layer.compressor = CompressorState.empty(ratio, args.head_dim, device, dtype)
            if ratio == 4:
                layer.indexer = CompressorState.empty(4, args.index_head_dim, device, dtype)
            layers.append(layer)
        return SequenceState(layers=layers)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch's tokens through every layer; returns the residual streams [N, hc, D] and advances each
        request's state."""
        for seq, start in zip(batch.states, batch.starts, strict=True):
            first = int(batch.positions[start])
            if first != seq.num_tokens:
                raise ValueError(f"request continues at position {first} but has processed {seq.num_tokens} tokens")
        h = self.embed(batch.input_ids)
        streams = h[:, None, :].expand(-1, self.args.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, batch)
        for i, seq in enumerate(batch.states):
            seq.num_tokens += batch.lens[i]
            seq.last_streams = streams[batch.starts[i] + batch.lens[i] - 1]
        return streams

    def logits(self, streams: torch.Tensor) -> torch.Tensor:
        """[M, hc, D] streams -> [M, vocab] fp32 logits."""
        return self.head(self.norm(self.hc_head(streams))).float()

    def mtp_logits(self, streams: torch.Tensor, next_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Logits of the token after `next_ids` from the first MTP layer, for the batch's positions."""
        if not self.mtp:
            raise ValueError("this checkpoint has no MTP layer")
        return self.head(self.mtp[0].predict(streams, self.embed(next_ids), batch)).float()
