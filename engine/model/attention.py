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
import triton
from torch import nn

from engine.cache.kv_cache import LayerKV
from engine.kernels.compressor import compress_chunk, compressor_decode_step
from engine.kernels.dispatch import splits_for, use_triton
from engine.kernels.indexer import indexer_logits, indexer_logits_triton
from engine.kernels.kv_format import main_page_rows
from engine.kernels.kv_rows import decode_row_lists, write_main_rows, write_window_rows
from engine.kernels.quant import index_queries, simulate_kv_row_fp8
from engine.kernels.rope import rms_rope, rope
from engine.kernels.sparse_attention import (
    attend_parts_with_sink,
    sparse_decode_attention,
    sparse_decode_attention_triton,
)
from engine.kernels.topk import topk_slots, topk_slots_triton
from engine.model.args import ModelArgs
from engine.model.layers import RMSNorm, Rotary
from engine.model.linear import GroupedColumnLinear, Layout, ProjectionGroup, RowParallelLinear
from engine.model.state import ForwardBatch
from engine.model.weight_formats import Formats, Unquantized

# Elements of the largest tensor the prefill path makes per block of queries (256 MiB in fp32): a chunk's
# attention memory is bounded by it, not by the chunk's length times the context's.
PREFILL_BUDGET = 2**26


def _ring_rows(slot: int, p0: int, positions: torch.Tensor, window: int) -> tuple[torch.Tensor, ...]:
    """A chunk's rows of the ring and of its span: the ring rows (of the slot's page) of the window rows before it,
    read before it overwrites them; the ring slots of its last window rows, written; its own rows in the span, after
    the window - 1 rows before it (int32)."""
    before = torch.arange(max(0, p0 - window + 1), p0, device=positions.device)
    tail = positions[-min(len(positions), window) :]
    return before % window, slot * window + tail % window, (positions - (p0 - window + 1)).int()


def _through_kernels(q: torch.Tensor) -> bool:
    """Whether the prefill attention runs through the decode kernels (`Attention._prefill_kernels`)."""
    return use_triton(q.device) and q.dtype != torch.float64


class Compressor(nn.Module):
    """Gated softmax pooling of every `ratio` tokens into one row (§5.2). Ratio 4 pools overlapping windows of 8:
    the first half of each token's projection feeds the next window, the second half its own. Its projections wkv
    and wgate (`width` features each) are members of the attention's fp32 projection group."""

    def __init__(self, args: ModelArgs, ratio: int, dim: int, rotary: Rotary, for_indexer: bool, quant_sim: bool):
        super().__init__()
        self.ratio, self.dim, self.overlap = ratio, dim, ratio == 4
        self.for_indexer, self.quant_sim = for_indexer, quant_sim
        self.rotary = rotary
        self.width = (2 if self.overlap else 1) * dim
        self.ape = nn.Parameter(torch.zeros(ratio, self.width, dtype=torch.float32))
        self.norm = RMSNorm(dim, args.rms_norm_eps)

    def compress(self, kv, score, positions: torch.Tensor, first: int, state, slots: torch.Tensor, out,
                 dtype: torch.dtype) -> None:  # fmt: skip
        """Prefill path: one request's next tokens, from position `first`; the rows of the windows they close go to
        physical `slots` of the cache's rows `out`."""
        compress_chunk(kv, score, positions, first, state[0], state[1], self.ape, self.norm.weight, self.norm.eps,
                       self.rotary.inv_freq, out.storage, slots, out.rows_per_page, self.ratio, self.for_indexer,
                       self.quant_sim, dtype)  # fmt: skip

    def decode_step(self, kv, score, batch: ForwardBatch, state, out) -> None:
        """Decode path: one token per request; closed windows' rows go straight into the paged cache."""
        compressor_decode_step(kv, score, self.ape, self.norm.weight, self.norm.eps, self.rotary.inv_freq, state[0],
                               state[1], batch.slots, batch.positions_i32, batch.page_table, out.storage,
                               out.rows_per_page, self.ratio, self.for_indexer, self.quant_sim)  # fmt: skip


class Indexer(nn.Module):
    """The lightning indexer of c4 layers (§5.3): score(t, j) = sum_h w_h ReLU(q_h . k_j), keep the top k. Its
    projections wq_b (of the q LoRA) and weights_proj (of x) are members of the attention's projection groups."""

    def __init__(self, args: ModelArgs, rotary: Rotary, quant_sim: bool):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.quant_sim = quant_sim
        self.rotary = rotary
        self.compressor = Compressor(args, 4, self.head_dim, rotary, for_indexer=True, quant_sim=quant_sim)

    def queries(self, q: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor):
        """(index queries [N, Hi, Di], head weights [N, Hi] with both scales folded in) from the projections
        wq_b(normed q LoRA) and weights_proj(x), column slices of the attention's fused GEMMs."""
        return index_queries(q, self.n_heads, positions, self.rotary.inv_freq, weights,
                             self.head_dim**-0.5 * self.n_heads**-0.5, self.quant_sim)  # fmt: skip

    @torch.no_grad()  # integer picks: training's gradient reaches the indexer through its distillation loss alone
    def select(self, q: torch.Tensor, w: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Top-k row ids per query [T, k] with -1 where fewer rows are visible; ties keep the lower row first. `keys`:
        the index keys of the rows the latest query sees (their count known on the host, so that nothing here waits
        for the device). Scores are made a block of rows at a time: each block's [T, heads, rows] products hold at
        most PREFILL_BUDGET elements (the caller keeps [T, rows] within it too)."""
        visible = (positions + 1) // 4
        n = len(keys)
        scores = torch.empty(len(q), n, dtype=torch.promote_types(torch.float32, w.dtype), device=q.device)
        block = max(1, PREFILL_BUDGET // (len(q) * self.n_heads))
        for a in range(0, n, block):
            products = torch.einsum("thd,nd->thn", q.to(scores.dtype), keys[a : min(a + block, n)].to(scores.dtype))
            scores[:, a : a + block] = products.relu_().mul_(w[..., None]).sum(dim=1)
        scores = scores.masked_fill_(torch.arange(n, device=q.device)[None, :] >= visible[:, None], float("-inf"))
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(self.topk, n)]
        return torch.where(picked >= visible[:, None], -1, picked)


class Attention(nn.Module):
    """`formats`, `layout`: the model's (engine/model/deepseek_v4.py); by default plain weights on one GPU."""

    def __init__(self, args: ModelArgs, layer_id: int, quant_sim: bool, formats: Formats | None = None,
                 layout: Layout | None = None):  # fmt: skip
        super().__init__()
        formats, layout = formats or Formats(), layout or Layout()
        self.layer_id = layer_id
        shard, p = layout.attention, f"{args.block_name(layer_id)}.attn"
        # A rank's heads (all of them unless attention is tensor-parallel): whole output-projection groups.
        first_group, self.n_groups = shard.part(args.o_groups, f"{p}.wo_a groups")
        heads_per_group = args.num_attention_heads // args.o_groups
        self.n_heads = heads_per_group * self.n_groups
        self.heads = slice(first_group * heads_per_group, first_group * heads_per_group + self.n_heads)
        self.head_dim, self.window = args.head_dim, args.sliding_window
        self.o_lora_rank, self.eps = args.o_lora_rank, args.rms_norm_eps
        self.ratio, self.quant_sim = args.compress_ratios[layer_id], quant_sim
        self.scale = self.head_dim**-0.5
        if self.ratio:  # compressed layers use the YaRN-scaled base; window-only layers the plain one
            self.rotary = Rotary(args.qk_rope_head_dim, args.compress_rope_theta, args.yarn)
        else:
            self.rotary = Rotary(args.qk_rope_head_dim, args.rope_theta, None)
        self.q_norm = RMSNorm(args.q_lora_rank, self.eps)
        self.kv_norm = RMSNorm(self.head_dim, self.eps)
        # Every head's sink (a plain tensor of the checkpoint); the rank's own are `sink`.
        self.attn_sink = nn.Parameter(torch.zeros(args.num_attention_heads, dtype=torch.float32))
        self.compressor = (
            Compressor(args, self.ratio, self.head_dim, self.rotary, for_indexer=False, quant_sim=quant_sim)
            if self.ratio
            else None
        )
        self.indexer = Indexer(args, self.rotary, quant_sim) if self.ratio == 4 else None
        # Training only (engine/tools/train_demo.py): a c4 layer's torch prefill attends every visible row, not the
        # indexer's top-k, as DeepSeek V3.2 warms its indexer up against dense attention: a query whose top-k misses
        # the rows it needs gets no gradient towards them.
        self.dense_warmup = False
        self.kv: LayerKV | None = None  # this layer's share of the paged cache, bound at boot
        # Projections that read the same input, as few GEMMs as their formats allow: of x, wq_a, wkv and the
        # indexer's weights_proj (shared by all heads: replicated); of the normed q LoRA, wq_b (split by heads) and
        # the indexer's wq_b; of x, with fp32 products, the compressors' wkv and wgate.
        dim, index = args.hidden_size, self.indexer
        x_members = [(f"{p}.wq_a", args.q_lora_rank, False), (f"{p}.wkv", self.head_dim, False)]
        qr_members = [(f"{p}.wq_b", args.num_attention_heads * self.head_dim, True)]
        if index is not None:
            x_members.append((f"{p}.indexer.weights_proj", index.n_heads, False))
            qr_members.append((f"{p}.indexer.wq_b", index.n_heads * index.head_dim, False))
        self.x_proj = ProjectionGroup(dim, [(n, r, formats.linear(n), s) for n, r, s in x_members], shard)
        self.qr_proj = ProjectionGroup(args.q_lora_rank, [(n, r, formats.linear(n), s) for n, r, s in qr_members],
                                       shard)  # fmt: skip
        fp32 = Unquantized(product=torch.float32)
        compressors = [(f"{p}.compressor", self.compressor), (f"{p}.indexer.compressor", index and index.compressor)]
        fp32_members = [(f"{name}.{w}", c.width, fp32, False) for name, c in compressors if c for w in ("wkv", "wgate")]
        self.x_fp32_proj = ProjectionGroup(dim, fp32_members, shard) if fp32_members else None
        self.wo_a = GroupedColumnLinear(args.o_groups, heads_per_group * self.head_dim, self.o_lora_rank, f"{p}.wo_a",
                                        formats.linear(f"{p}.wo_a"), shard)  # fmt: skip
        self.wo_b = RowParallelLinear(args.o_groups * self.o_lora_rank, [(f"{p}.wo_b", dim)],
                                      formats.linear(f"{p}.wo_b"), shard)  # fmt: skip

    @property
    def sink(self) -> torch.Tensor:
        """The attention sinks of this rank's heads."""
        return self.attn_sink[self.heads]

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        pos = batch.positions
        q_a, kv_x, *index_w = self.x_proj(x)
        qr = self.q_norm(q_a)
        q_b, *index_q = self.qr_proj(qr)
        # per-head RMS norm (weightless), then RoPE on the last rope_dim channels
        q = rms_rope(q_b.view(-1, self.n_heads, self.head_dim), pos, self.rotary.inv_freq, self.eps)
        proj = {}
        if self.compressor is not None:  # fp32 projections, as the reference runs them: (kv, gate score) pairs
            # (a float64 model's product is exact before the fp32 rounding, so it does not depend on chunking)
            comp = [c.float() for c in self.x_fp32_proj(x)]
            proj["comp"] = (comp[0], comp[1])
            if self.indexer is not None:
                proj["index"] = (comp[2], comp[3])
                proj["query"] = self.indexer.queries(index_q[0], index_w[0], pos)
        if batch.decoding:
            out = self._decode(q, kv_x, proj, batch)
        else:
            kv = self.rotary(self.kv_norm(kv_x), pos)
            if self.quant_sim and not (self.kv.ring.fp8 and _through_kernels(q)):  # FP8 rows: encoding rounds it
                kv = simulate_kv_row_fp8(kv, self.rotary.rope_dim)
            # Each tensor split once into its requests' rows, not sliced a request at a time: a split's backward (the
            # demo model's training) is one concatenation, a slice's a zero tensor of the whole batch per request.
            proj_rows = [[(a, b) for a, b in zip(x.split(batch.lens), y.split(batch.lens), strict=True)]
                         for x, y in proj.values()]  # fmt: skip
            requests = zip(batch.states, q.split(batch.lens), kv.split(batch.lens), pos.split(batch.lens), strict=True)
            parts = []
            for i, (seq, q_i, kv_i, pos_i) in enumerate(requests):
                chunk = {k: rows[i] for k, rows in zip(proj, proj_rows, strict=True)}
                parts.append(self._prefill(q_i, kv_i, chunk, pos_i, seq, batch, i))
                if i in batch.snapshots_after:  # the slot as it is at the boundary, before the next row moves on
                    self.kv.copy_slots(*batch.snapshots_after[i])
            out = parts[0] if len(parts) == 1 else torch.cat(parts)
        # values carried RoPE: cast to the model dtype and rotate back to the query position
        o = rope(out, pos, self.rotary.inv_freq, inverse=True, dtype=x.dtype)
        o = o.view(-1, self.n_groups, self.n_heads * self.head_dim // self.n_groups)
        return self.wo_b(self.wo_a(o).flatten(1))

    def _prefill(self, q, kv, proj, positions, seq, batch: ForwardBatch, i: int) -> torch.Tensor:
        """Any number of one request's tokens: their rows go into the cache, then each query attends to its own keys
        only: its window rows, then its top-k compressed rows (c4) or the compressed rows it sees (c128), through the
        decode kernels on CUDA (`_prefill_kernels`), in torch elsewhere and for float64 (`_prefill_reference`).
        The request is row i of the batch (its slot, its row of the device-side page table)."""
        cache, slot, p0 = self.kv, seq.slot, seq.num_tokens  # the row's first position, known on the host
        window, dim = self.window, kv.shape[-1]
        # The window rows before this chunk, read before the chunk overwrites their ring slots, then the chunk's own,
        # front-padded to window - 1 rows: query i's window is rows i .. i + window - 1 of this span. The ring slots
        # are every layer's alike (each has its own ring): made once a step.
        read, written, own_row = batch.per_step(("ring", i, window), self.layer_id,
                                                lambda: _ring_rows(slot, p0, positions, window))  # fmt: skip
        kernels = _through_kernels(q)
        if kernels and cache.ring.fp8:
            span = self._fp8_span(read, kv, slot, own_row)
        else:
            ring = cache.ring.read(read + slot * window).to(kv.dtype)
            span = torch.cat([kv.new_zeros(window - 1 - len(read), dim), ring, kv])
        cache.ring.write(written, kv[-len(written) :])
        comp_slots = index_slots = None
        if self.compressor is not None:
            n_old, n = p0 // self.ratio, (p0 + len(positions)) // self.ratio
            per_page = cache.comp.rows_per_page
            comp_slots = batch.per_step(("row slots", i, n, per_page), self.layer_id,
                                        lambda: batch.row_slots(i, 0, n, per_page))  # fmt: skip
            self.compressor.compress(*proj["comp"], positions, p0, cache.comp_state_of(slot), comp_slots[n_old:],
                                     cache.comp, kv.dtype)  # fmt: skip
            if self.indexer is not None:
                # c4's index keys and compressed rows keep as many rows a page: the same slots
                index_slots = (comp_slots if cache.index.rows_per_page == per_page
                               else batch.row_slots(i, 0, n, cache.index.rows_per_page))  # fmt: skip
                self.indexer.compressor.compress(*proj["index"], positions, p0, cache.index_state_of(slot),
                                                 index_slots[n_old:], cache.index, kv.dtype)  # fmt: skip
        if kernels:
            return self._prefill_kernels(q, proj, positions, own_row, span, comp_slots, batch, i)
        return self._prefill_reference(q, proj, positions, p0, span, comp_slots, index_slots)

    def _fp8_span(self, ring_rows: torch.Tensor, kv: torch.Tensor, slot: int, own_row: torch.Tensor) -> torch.Tensor:
        """The span in the ring's FP8 row format, `window` rows a page: the window rows before the chunk copied from
        the ring as they are (their bytes: a row decoded and encoded again would be the same row), then the chunk's
        rows encoded, after zero rows up to window - 1."""
        ring, window = self.kv.ring, self.window
        span = ring.storage.new_zeros(-(-(window - 1 + len(kv)) // window), ring.storage.shape[1])
        if len(ring_rows):
            at = window - 1 - len(ring_rows)  # rows before the chunk's own lie within the span's first page
            pages = [main_page_rows(storage, page, window, ring.head_dim, ring.rope_dim)
                     for storage, page in ((span, 0), (ring.storage, slot))]  # fmt: skip
            for dst, src in zip(*pages, strict=True):
                dst[at : at + len(ring_rows)] = src.index_select(0, ring_rows)
        write_main_rows(span, own_row, kv, window, ring.rope_dim)
        return span

    def _prefill_reference(self, q, proj, positions, p0, span, comp_slots, index_slots) -> torch.Tensor:
        """The prefill attention in torch, of queries at positions p0, p0 + 1, ... Queries go in blocks sized so that
        no tensor of a block exceeds PREFILL_BUDGET elements (index scores over the visible rows, gathered keys,
        attention scores); what is made once per chunk is the size of the chunk's own kv or of the request's index
        keys / c128 rows, like what the cache holds. The compressed rows a block's last query sees are counted on the
        host from p0: read from the device, each block of a training step waited for it."""
        cache, window, dim = self.kv, self.window, span.shape[-1]
        windows = span.unfold(0, window, 1).transpose(1, 2)  # query i's window rows, a view
        in_window = positions[:, None] - window + 1 + torch.arange(window, device=q.device)[None, :] >= 0
        seen = gathered = window  # per query: keys scored, keys copied for it
        index_rows = 0  # per query: index scores
        sparse = self.indexer is not None and not self.dense_warmup
        if sparse:
            index_keys = cache.index.read(index_slots).to(span.dtype)
            seen = gathered = window + self.indexer.topk
            index_rows = len(index_slots)
        elif self.compressor is not None:  # c128 (or dense c4): every row whose window has closed, for all queries
            compressed = cache.comp.read(comp_slots).to(span.dtype)
            visible = (positions + 1) // self.ratio
            seen = window + len(comp_slots)
        per_query = max(self.n_heads * seen, dim * gathered, self.n_heads * dim, index_rows)
        step = max(1, PREFILL_BUDGET // per_query)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for a in range(0, len(q), step):
            # One block of all the queries takes each tensor whole (`...`, an alias to autograd): a slice's backward,
            # even of every row, fills a zero tensor of its input, here every query's gathered window.
            b = slice(a, a + step) if step < len(q) else ...
            seen_rows = (p0 + min(a + step, len(q))) // max(1, self.ratio)  # by the block's last query
            parts = [(windows[b], in_window[b])]
            if sparse:
                picked = self.indexer.select(proj["query"][0][b], proj["query"][1][b], positions[b],
                                             index_keys[:seen_rows])  # fmt: skip
                chosen = cache.comp.read(comp_slots[picked.clamp(min=0)].flatten()).to(span.dtype)
                parts.append((chosen.unflatten(0, picked.shape), picked >= 0))
            elif self.compressor is not None:
                parts.append((compressed[:seen_rows],
                              torch.arange(seen_rows, device=q.device)[None, :] < visible[b, None]))  # fmt: skip
            out[b] = attend_parts_with_sink(q[b], parts, self.sink, self.scale)
        return out

    def _prefill_kernels(self, q, proj, positions, own_row, span, comp_slots, batch: ForwardBatch,
                         i: int) -> torch.Tensor:  # fmt: skip
        """The prefill attention through the decode kernels, each query one batch row: its window rows from the span
        (in the ring's row format, so FP8 rows hold what the ring holds), then the indexer's top-k of its c4 rows, or
        the c128 rows it sees (one list, a stride-0 row per query). c4 queries go in blocks whose index logits, one
        fp32 per c4 row of the request, hold at most PREFILL_BUDGET elements; no block waits for the device.
        Launch shapes depend only on the power of two above a block's size (at least 2: the warm-up's one-token
        chunk is a decode row, so it never runs a one-query block), so the kernels compile few variants and
        the boot warm-up makes them all: blocks of a multiple of 16 queries (per-query slices stay 64-byte aligned),
        splits from that power of two, logits rows of whole pages, top-k lists of k columns, an aligned table, and
        rows shared by all queries with stride 0 also for one query (`expand` keeps a single row's own stride, which
        Triton specialises: the H200 compiled four variants after boot for one-token chunks)."""
        cache, window = self.kv, self.window
        # What the queries read is every layer's of this kind alike: made once a step.
        positions, visible, lists, lengths, table = batch.per_step(
            ("query rows", i, self.ratio, window), self.layer_id,
            lambda: self._query_rows(positions, comp_slots, batch.page_table[i]),
        )  # fmt: skip
        comp_rows, rows_per_page, step = span, window, len(q)
        if self.compressor is not None:
            comp_rows, rows_per_page = cache.comp.storage, cache.comp.rows_per_page
        if self.indexer is not None:
            k, n = self.indexer.topk, max(len(comp_slots), 1)  # a launch needs a column even before the first c4 row
            step = min(len(q), max(16, PREFILL_BUDGET // n // 16 * 16))
            logits = torch.empty(step, -(-n // 64) * 64, device=q.device)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        for a in range(0, len(q), step):
            b = slice(a, a + step)
            m = len(positions[b])
            width = max(2, triton.next_power_of_2(m))  # a one-query block launches as a two-query one
            if self.indexer is not None:
                tables = table.as_strided((m, len(table)), (0, 1))
                iq, iw = proj["query"]
                indexer_logits_triton(iq[b], iw[b], cache.index.values, cache.index.scales, tables, visible[b],
                                      logits[:m], splits=splits_for(width, q.device, waves=5))  # fmt: skip
                picked = torch.empty(m, k, dtype=torch.int32, device=q.device)
                topk_slots_triton(logits[:m], visible[b], tables, k, picked,
                                  splits=splits_for(width, q.device, waves=1, cap=128))  # fmt: skip
            else:
                picked = lists.as_strided((m, lists.shape[1]), (0, 1))
            splits = splits_for(width, q.device, waves=1, cap=16)
            sparse_decode_attention_triton(q[b], self.sink, self.scale, span, own_row[b], positions[b], comp_rows,
                                           rows_per_page, picked, lengths[b], out[b], window, self.rotary.rope_dim,
                                           window_span=True, splits=splits)  # fmt: skip
        return out

    def _query_rows(self, positions, comp_slots, page_table):
        """A request's chunk of queries as the prefill kernels read it: positions (int32), its visible compressed
        rows, the compressed rows' list (none: window-only, and c128 before its first row; every row: c128, each
        query reads its visible ones; c4 picks each block's top-k) with each query's length of it, and the indexer's
        page table (c4)."""
        positions = positions.int()
        visible = (positions + 1) // self.ratio if self.ratio else torch.zeros_like(positions)
        lists, lengths, table = torch.full((1, 1), -1, dtype=torch.int32, device=positions.device), visible, None
        if self.compressor is not None and self.indexer is None and comp_slots.numel():
            lists = comp_slots.int()[None]
        if self.indexer is not None:
            lengths = visible.clamp(max=self.indexer.topk)
            table = page_table.clone()  # a row of the batch's table sits at any offset
        return positions, visible, lists, lengths, table

    def _decode(self, q, kv_x, proj, batch: ForwardBatch) -> torch.Tensor:
        """One token per request, batched, through the kernels (Triton on CUDA, the references elsewhere)."""
        cache = self.kv
        positions = batch.positions_i32
        # kv_norm, RoPE and the (FP8) row write into the window ring, one kernel. A decode step writes kv only to
        # the ring, whose FP8 rounding is the simulation's (same blocks, same power-of-two scales): it rounds once.
        write_window_rows(kv_x, self.kv_norm.weight, self.eps, positions, self.rotary.inv_freq, cache.ring.storage,
                          batch.slots, self.window, self.quant_sim)  # fmt: skip
        comp_rows, rows_per_page = cache.ring.storage, self.window
        if self.compressor is not None:
            self.compressor.decode_step(*proj["comp"], batch, cache.comp_state, cache.comp)
            comp_rows, rows_per_page = cache.comp.storage, cache.comp.rows_per_page
        if self.indexer is not None:
            self.indexer.compressor.decode_step(*proj["index"], batch, cache.index_state, cache.index)
        # What this layer kind's queries see of the compressed rows: the same for every layer of the kind, made once
        # a step (the row lists of c128 layers: every visible row, in order).
        limit = self.indexer.topk if self.indexer is not None else (2**31 - 1 if self.ratio else 0)
        visible, comp_len, comp_slots = batch.per_step(
            ("rows", self.ratio),
            self.layer_id,
            lambda: decode_row_lists(positions, batch.page_table, self.ratio, rows_per_page, limit,
                                     with_slots=self.ratio > 4),
        )  # fmt: skip
        if self.indexer is not None:
            iq, iw = proj["query"]
            logits = torch.empty(len(positions), batch.page_table.shape[1] * 64, device=q.device)
            indexer_logits(iq, iw, cache.index.values, cache.index.scales, batch.page_table, visible, logits)
            comp_slots = torch.empty(len(positions), self.indexer.topk, dtype=torch.int32, device=q.device)
            topk_slots(logits, visible, batch.page_table, self.indexer.topk, comp_slots)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        return sparse_decode_attention(q, self.sink, self.scale, cache.ring.storage, batch.slots, positions,
                                       comp_rows, rows_per_page, comp_slots, comp_len, out, self.window,
                                       self.rotary.rope_dim)  # fmt: skip
