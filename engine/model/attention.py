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

from engine.cache.kv_cache import LayerKV
from engine.kernels.compressor import compressor_decode_step, finish_rows, pool_windows
from engine.kernels.indexer import indexer_logits
from engine.kernels.quant import simulate_index_fp4, simulate_kv_row_fp8
from engine.kernels.rope import rms_rope, rope
from engine.kernels.sparse_attention import attend_with_sink, sparse_decode_attention
from engine.kernels.topk import topk_slots
from engine.model.args import ModelArgs
from engine.model.layers import RMSNorm, Rotary
from engine.model.state import ForwardBatch


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

    def compress(self, kv, score, positions: torch.Tensor, state, first_row: int, dtype: torch.dtype):
        """Prefill path: one request's next tokens; the rows of the windows they close (dense, [n, dim])."""
        pooled = pool_windows(kv, score, positions, state[0], state[1], self.ape, self.ratio)
        return finish_rows(pooled, first_row, self.ratio, self.norm.weight, self.norm.eps, self.rotary.inv_freq,
                           self.for_indexer, self.quant_sim, dtype)  # fmt: skip

    def decode_step(self, kv, score, batch: ForwardBatch, state, out) -> None:
        """Decode path: one token per request; closed windows' rows go straight into the paged cache."""
        compressor_decode_step(kv, score, self.ape, self.norm.weight, self.norm.eps, self.rotary.inv_freq, state[0],
                               state[1], batch.slots, batch.positions_i32, batch.page_table, out, self.ratio,
                               self.for_indexer, self.quant_sim)  # fmt: skip


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
        self.kv: LayerKV | None = None  # this layer's share of the paged cache, given by allocate_kv_cache

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pos = batch.positions
        qr = self.q_norm(self.wq_a(x))
        # per-head RMS norm (weightless), then RoPE on the last rope_dim channels
        q = rms_rope(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), pos, self.rotary.inv_freq, self.eps)
        kv = self.rotary(self.kv_norm(self.wkv(x)), pos)
        # A decode step only writes kv to FP8 rows, whose quantisation is the simulation's (same blocks, same
        # power-of-two scales): rounding twice stores the same values (tests/unit/test_quant.py), so it rounds once.
        if self.quant_sim and not (batch.decoding and self.kv.ring.fp8):
            kv = simulate_kv_row_fp8(kv, self.rotary.rope_dim)
        proj = {"comp": self.compressor.project(x)} if self.compressor is not None else {}
        if self.indexer is not None:
            proj["index"] = self.indexer.compressor.project(x)
            proj["query"] = self.indexer.queries(x, qr, pos)
        if batch.decoding:
            out = self._decode(q, kv, proj, batch)
        else:
            parts = []
            for i, seq in enumerate(batch.states):
                r = batch.rows(i)
                parts.append(self._prefill(q[r], kv[r], {k: (a[r], b[r]) for k, (a, b) in proj.items()}, pos[r], seq))
            out = torch.cat(parts)
        # values carried RoPE: cast to the model dtype and rotate back to the query position
        o = rope(out, pos, self.rotary.inv_freq, inverse=True, dtype=x.dtype)
        o = o.view(-1, self.n_groups, self.n_heads * self.head_dim // self.n_groups)
        wo_a = self.wo_a.weight.view(self.n_groups, self.o_lora_rank, -1)
        return self.wo_b(torch.einsum("ngd,grd->ngr", o, wo_a).flatten(1))

    def _prefill(self, q, kv, proj, positions, seq) -> torch.Tensor:
        """Any number of one request's tokens, on dense copies of what the cache holds for it (the reference path)."""
        cache, table, slot, p0 = self.kv, seq.table, seq.slot, int(positions[0])
        rows_per_ring = self.window
        # The window keys before this chunk, read before the chunk overwrites their ring slots.
        prev = torch.arange(max(0, p0 - self.window + 1), p0, device=q.device)
        keys = torch.cat([cache.ring.read(slot * rows_per_ring + prev % rows_per_ring).to(kv.dtype), kv])
        key_pos = torch.cat([prev, positions])
        delta = positions[:, None] - key_pos[None, :]
        allowed = (delta >= 0) & (delta < self.window)
        tail = positions[-min(len(positions), self.window) :]
        cache.ring.write(slot * rows_per_ring + tail % rows_per_ring, kv[-len(tail) :])
        if self.compressor is not None:
            n_old = p0 // self.ratio
            new_rows = self.compressor.compress(*proj["comp"], positions, cache.comp_state_of(slot), n_old, kv.dtype)
            n = n_old + len(new_rows)
            cache.comp.write(table.slots(n_old, n, cache.comp.rows_per_page, q.device), new_rows)
            compressed = cache.comp.read(table.slots(0, n, cache.comp.rows_per_page, q.device)).to(kv.dtype)
            if self.indexer is not None:
                new_keys = self.indexer.compressor.compress(*proj["index"], positions, cache.index_state_of(slot),
                                                            n_old, kv.dtype)  # fmt: skip
                cache.index.write(table.slots(n_old, n, 64, q.device), new_keys)
                index_keys = cache.index.read(table.slots(0, n, 64, q.device)).to(kv.dtype)
                chosen = _rows_mask(self.indexer.select(*proj["query"], positions, index_keys), n)
            else:  # c128: every row whose window has closed
                chosen = torch.arange(n, device=q.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
            keys = torch.cat([keys, compressed])
            allowed = torch.cat([allowed, chosen], dim=1)
        return attend_with_sink(q, keys, allowed, self.attn_sink, self.scale)

    def _decode(self, q, kv, proj, batch: ForwardBatch) -> torch.Tensor:
        """One token per request, batched, through the kernels (Triton on CUDA, the references elsewhere)."""
        cache = self.kv
        positions = batch.positions_i32
        cache.ring.write(batch.slots.long() * self.window + batch.positions % self.window, kv)
        comp_rows, rows_per_page = cache.ring.storage, self.window
        comp_slots = torch.full((len(positions), 1), -1, dtype=torch.int32, device=q.device)
        comp_len = torch.zeros_like(positions)
        if self.compressor is not None:
            self.compressor.decode_step(*proj["comp"], batch, cache.comp_state, cache.comp)
            comp_rows, rows_per_page = cache.comp.storage, cache.comp.rows_per_page
            visible = (positions + 1) // self.ratio
            if self.indexer is not None:
                self.indexer.compressor.decode_step(*proj["index"], batch, cache.index_state, cache.index)
                iq, iw = proj["query"]
                logits = torch.empty(len(positions), batch.page_table.shape[1] * 64, device=q.device)
                indexer_logits(iq, iw, cache.index.values, cache.index.scales, batch.page_table, visible, logits)
                comp_slots = torch.empty(len(positions), self.indexer.topk, dtype=torch.int32, device=q.device)
                topk_slots(logits, visible, batch.page_table, self.indexer.topk, comp_slots)
                comp_len = visible.clamp(max=self.indexer.topk)
            else:  # c128: every closed window's row, in order
                rows = torch.arange(batch.page_table.shape[1] * rows_per_page, device=q.device)
                pages = batch.page_table[:, rows // rows_per_page].long()
                comp_slots = torch.where(rows[None, :] < visible[:, None], pages * rows_per_page + rows % rows_per_page,
                                         -1).int()  # fmt: skip
                comp_len = visible
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        return sparse_decode_attention(q, self.attn_sink, self.scale, cache.ring.storage, batch.slots, positions,
                                       comp_rows, rows_per_page, comp_slots, comp_len, out, self.window,
                                       self.rotary.rope_dim)  # fmt: skip


def _rows_mask(picked: torch.Tensor, n: int) -> torch.Tensor:
    """[T, k] row ids (-1 = none) -> [T, n] bool."""
    mask = torch.zeros(picked.shape[0], n + 1, dtype=torch.bool, device=picked.device)
    mask.scatter_(1, torch.where(picked < 0, n, picked), True)
    return mask[:, :n]
