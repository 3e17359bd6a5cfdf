"""Shared-KV attention with a sliding window, compressed rows and an attention sink (reference §5).

Per token: a q LoRA with per-head RMS norm, one 512-d KV row that is both key and value, RoPE on the last 64
channels. Every layer attends to its last `sliding_window` rows; c4 layers also to the top-k compressed rows chosen
by the lightning indexer, c128 layers to all visible compressed rows. The output's RoPE channels are rotated back
to the query position before the grouped low-rank output projection.

Dense projections run over the whole flattened batch; compression, selection and attention run per request over
that request's own state, so the work per step follows each request's actual length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels.compressor import finish_rows, pool_windows
from engine.kernels.quant import simulate_index_fp4, simulate_kv_row_fp8
from engine.kernels.sparse_attention import attend_with_sink
from engine.model.args import ModelArgs
from engine.model.layers import RMSNorm, Rotary, rms_normalize
from engine.model.state import CompressorState, ForwardBatch, LayerState


class Compressor(nn.Module):
    """Gated softmax pooling of every `ratio` tokens into one row (§5.2). Ratio 4 pools overlapping windows of 8:
    the first half of each token's projection feeds the next window, the second half its own."""

    def __init__(self, args: ModelArgs, ratio: int, dim: int, rotary: Rotary, for_indexer: bool, quant_sim: bool):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        self.for_indexer, self.quant_sim = for_indexer, quant_sim
        self.rotary = rotary
        coff = 2 if self.overlap else 1
        self.ape = nn.Parameter(torch.zeros(ratio, coff * dim, dtype=torch.float32))
        self.wkv = nn.Linear(args.hidden_size, coff * dim, bias=False, dtype=torch.float32)
        self.wgate = nn.Linear(args.hidden_size, coff * dim, bias=False, dtype=torch.float32)
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-token projections, in fp32 as the reference runs them: (kv, gate score)."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def update(self, kv: torch.Tensor, score: torch.Tensor, positions: torch.Tensor, state: CompressorState) -> None:
        """Feed one request's next tokens; append a row to `state.rows` for every window they close."""
        pooled = pool_windows(kv, score, positions, state.kv, state.score, self.ape, self.ratio)
        if len(pooled):
            rows = finish_rows(pooled, state.rows.shape[0], self.ratio, self.norm.weight, self.norm.eps,
                               self.rotary.inv_freq, self.for_indexer, self.quant_sim, state.rows.dtype)  # fmt: skip
            state.rows = torch.cat([state.rows, rows])


class Indexer(nn.Module):
    """The lightning indexer of c4 layers (§5.3): score(t, j) = sum_h w_h ReLU(q_h . k_j), keep the top k."""

    def __init__(self, args: ModelArgs, rotary: Rotary, quant_sim: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.quant_sim = quant_sim
        self.rotary = rotary
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(args.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(args, 4, self.head_dim, rotary, for_indexer=True, quant_sim=quant_sim)

    def queries(self, x: torch.Tensor, qr: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index queries [N, Hi, Di], head weights [N, Hi] with both scales folded in)."""
        q = self.rotary(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), positions)
        if self.quant_sim:
            q = simulate_index_fp4(q)
        w = self.weights_proj(x).float() * (self.head_dim**-0.5 * self.n_heads**-0.5)
        return q, w

    def select(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Top-k row ids per query [T, k] with -1 where fewer rows are visible; ties keep the lower row first."""
        n = keys.shape[0]
        scores = (F.relu(torch.einsum("thd,nd->thn", q.float(), keys.float())) * w[..., None]).sum(dim=1)
        visible = (positions + 1) // 4
        scores = scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= visible[:, None], float("-inf"))
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(self.topk, n)]
        return torch.where(picked >= visible[:, None], -1, picked)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim, self.window = args.num_attention_heads, args.head_dim, args.sliding_window
        self.n_groups, self.o_lora_rank, self.eps = args.o_groups, args.o_lora_rank, args.rms_norm_eps
        self.ratio, self.quant_sim = args.compress_ratios[layer_id], quant_sim
        self.scale = self.head_dim**-0.5
        if self.ratio:  # compressed layers use the YaRN-scaled base; window-only layers the plain one
            self.rotary = Rotary(args.qk_rope_head_dim, args.compress_rope_theta, args.yarn)
        else:
            self.rotary = Rotary(args.qk_rope_head_dim, args.rope_theta, None)
        self.wq_a = nn.Linear(args.hidden_size, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, self.eps)
        self.wq_b = nn.Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(args.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        self.wo_a = nn.Linear(
            self.n_heads * self.head_dim // self.n_groups, self.n_groups * self.o_lora_rank, bias=False
        )
        self.wo_b = nn.Linear(self.n_groups * self.o_lora_rank, args.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads, dtype=torch.float32))
        self.compressor = (
            Compressor(args, self.ratio, self.head_dim, self.rotary, for_indexer=False, quant_sim=quant_sim)
            if self.ratio
            else None
        )
        self.indexer = Indexer(args, self.rotary, quant_sim) if self.ratio == 4 else None

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pos = batch.positions
        qr = self.q_norm(self.wq_a(x))
        q = rms_normalize(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), self.eps)
        q = self.rotary(q, pos)
        kv = self.rotary(self.kv_norm(self.wkv(x)), pos)
        if self.quant_sim:
            kv = simulate_kv_row_fp8(kv, self.rotary.rope_dim)
        if self.compressor is not None:
            ckv, cscore = self.compressor.project(x)
        if self.indexer is not None:
            iq, iw = self.indexer.queries(x, qr, pos)
            ikv, iscore = self.indexer.compressor.project(x)

        out = torch.empty(q.shape, dtype=torch.float32, device=x.device)
        for i, seq in enumerate(batch.states):
            rows, layer = batch.rows(i), seq.layers[self.layer_id]
            p = pos[rows]
            keys, allowed = self._window(kv[rows], p, layer)
            if self.compressor is not None:
                self.compressor.update(ckv[rows], cscore[rows], p, layer.compressor)
                compressed = layer.compressor.rows
                if self.indexer is not None:
                    self.indexer.compressor.update(ikv[rows], iscore[rows], p, layer.indexer)
                    picked = self.indexer.select(iq[rows], iw[rows], p, layer.indexer.rows)
                    chosen = _rows_mask(picked, compressed.shape[0])
                else:  # c128: every row whose window has closed
                    ids = torch.arange(compressed.shape[0], device=x.device)
                    chosen = ids[None, :] < ((p + 1) // self.ratio)[:, None]
                keys = torch.cat([keys, compressed])
                allowed = torch.cat([allowed, chosen], dim=1)
            out[rows] = attend_with_sink(q[rows], keys, allowed, self.attn_sink, self.scale)

        o = self.rotary(out.to(x.dtype), pos, inverse=True)  # values carried RoPE: rotate back to the query
        o = o.view(-1, self.n_groups, self.n_heads * self.head_dim // self.n_groups)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("ngd,grd->ngr", o, wo_a).flatten(1))

    def _window(
        self, kv: torch.Tensor, positions: torch.Tensor, layer: LayerState
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys of the sliding window for these tokens, and which each query may see: [t - window + 1, t]."""
        keys = torch.cat([layer.window, kv])
        key_pos = torch.arange(keys.shape[0], device=kv.device) + (positions[0] - layer.window.shape[0])
        delta = positions[:, None] - key_pos[None, :]
        layer.window = keys[keys.shape[0] - min(keys.shape[0], self.window - 1) :]
        return keys, (delta >= 0) & (delta < self.window)


def _rows_mask(picked: torch.Tensor, n: int) -> torch.Tensor:
    """[T, k] row ids (-1 = none) -> [T, n] bool."""
    mask = torch.zeros(picked.shape[0], n + 1, dtype=torch.bool, device=picked.device)
    mask.scatter_(1, torch.where(picked < 0, n, picked), True)
    return mask[:, :n]
