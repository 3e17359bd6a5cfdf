"""Storage of one layer's KV rows in pages, in the serving byte formats (reference §11.2), with the plain-torch
codecs that write and read them.

Main rows (window ring, c4 and c128 compressed rows), `rows_per_page` rows a page:
- bfloat16 (or float32, for fp32 models on the CPU): `[pages * rows_per_page, head_dim]`;
- fp8_e4m3: `[pages, rows_per_page * 584]` bytes. A page holds its rows' data first (each 448 e4m3 nope channels,
  then 64 bf16 RoPE channels = 576 B), then their scales (7 ue8m0 bytes, one per 64 nope channels, + 1 pad).
Index keys (c4 layers), 64 rows a page:
- bfloat16 / float32: `[pages * 64, index_head_dim]`;
- fp8_e4m3: `[pages, 64 * (128 + 4)]` bytes, block-major: 64 x 128 e4m3 values, then 64 fp32 row scales.
"""

from __future__ import annotations

import torch

from engine.kernels.kv_rows import write_main_rows
from engine.kernels.quant import FP8_MAX

SCALE_BLOCK = 64
SCALE_BYTES = 8  # 7 ue8m0 scales for 448 nope channels, padded


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    return torch.exp2(torch.ceil(torch.log2(amax.clamp_min(1e-30) / FP8_MAX)))


class MainRows:
    """One layer's main KV rows in pages."""

    def __init__(self, num_pages: int, rows_per_page: int, head_dim: int, rope_dim: int, dtype: str, device):
        self.rows_per_page, self.head_dim, self.rope_dim, self.fp8 = (
            rows_per_page,
            head_dim,
            rope_dim,
            dtype == "fp8_e4m3",
        )
        self.nope = head_dim - rope_dim
        if self.fp8:
            self.data_bytes = self.nope + 2 * rope_dim  # 576 for V4-Flash
            self.row_bytes = self.data_bytes + SCALE_BYTES
            assert self.nope // SCALE_BLOCK <= SCALE_BYTES
            self.storage = torch.zeros(num_pages, rows_per_page * self.row_bytes, dtype=torch.uint8, device=device)
        else:
            self.storage = torch.zeros(num_pages * rows_per_page, head_dim, dtype=getattr(torch, dtype), device=device)

    def write(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """rows [N, head_dim] -> physical `slots` [N]."""
        if not self.fp8:
            self.storage[slots] = rows.to(self.storage.dtype)
            return
        write_main_rows(self.storage, slots, rows, self.rows_per_page, self.rope_dim)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """Physical `slots` [N] -> rows [N, head_dim] fp32 (dequantised)."""
        return read_main_rows(self.storage, slots, self.rows_per_page, self.head_dim, self.rope_dim)


def read_main_rows(storage: torch.Tensor, slots: torch.Tensor, rows_per_page: int, head_dim: int, rope_dim: int):
    """Rows at physical `slots` of a `MainRows.storage` (bf16 rows, or fp8 pages when the storage is bytes), fp32."""
    if storage.dtype != torch.uint8:
        return storage[slots.long()].float()
    nope, data_bytes = head_dim - rope_dim, head_dim - rope_dim + 2 * rope_dim
    slots = slots.long()
    page, row = slots // rows_per_page, slots % rows_per_page
    raw = storage[page[:, None], (row * data_bytes)[:, None] + torch.arange(data_bytes, device=slots.device)]
    values = raw[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    rope = raw[:, nope:].contiguous().view(torch.bfloat16).float()
    scale_at = rows_per_page * data_bytes + row * SCALE_BYTES
    exps = storage[page[:, None], scale_at[:, None] + torch.arange(nope // SCALE_BLOCK, device=slots.device)]
    scale = torch.exp2(exps.float() - 127).repeat_interleave(SCALE_BLOCK, dim=1)
    return torch.cat([values * scale, rope], dim=1)


class IndexKeys:
    """One c4 layer's indexer keys in pages of 64 rows."""

    ROWS = 64
    rows_per_page = ROWS

    def __init__(self, num_pages: int, dim: int, dtype: str, device):
        self.dim, self.fp8 = dim, dtype == "fp8_e4m3"
        if self.fp8:
            self.storage = torch.zeros(num_pages, self.ROWS * (dim + 4), dtype=torch.uint8, device=device)
        else:
            self.storage = torch.zeros(num_pages * self.ROWS, dim, dtype=getattr(torch, dtype), device=device)

    @property
    def values(self) -> torch.Tensor:
        """[pages, 64, dim] view the kernels index as page * stride(0) + row * stride(1)."""
        if self.fp8:
            return self.storage[:, : self.ROWS * self.dim].view(torch.float8_e4m3fn).unflatten(1, (self.ROWS, self.dim))
        return self.storage.view(-1, self.ROWS, self.dim)

    @property
    def scales(self) -> torch.Tensor | None:
        """[pages, 64] fp32 row scales (fp8 only)."""
        return self.storage[:, self.ROWS * self.dim :].view(torch.float32) if self.fp8 else None

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        page, row = slots.long() // self.ROWS, slots.long() % self.ROWS
        if not self.fp8:
            self.values[page, row] = keys.to(self.storage.dtype)
            return
        scale = _pow2_scale(keys.float().abs().amax(-1))
        self.values[page, row] = (keys.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        self.scales[page, row] = scale

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        page, row = slots.long() // self.ROWS, slots.long() % self.ROWS
        keys = self.values[page, row].float()
        return keys * self.scales[page, row][:, None] if self.fp8 else keys


class LayerKV:
    """One layer's share of the cache: the window rings (one page of `window` rows per request slot), the compressed
    rows and index keys in pages, and the compressors' unfinished windows per request slot."""

    def __init__(self, ratio: int, num_pages: int, num_slots: int, args, page_size: int, kv_dtype: str, device):
        self.ratio = ratio
        dim, rope = args.head_dim, args.qk_rope_head_dim
        self.ring = MainRows(num_slots, args.sliding_window, dim, rope, kv_dtype, device)
        self.comp = MainRows(num_pages, page_size // ratio, dim, rope, kv_dtype, device) if ratio else None
        self.index = IndexKeys(num_pages, args.index_head_dim, kv_dtype, device) if ratio == 4 else None
        coff = 2 if ratio == 4 else 1
        self.comp_state = _compressor_buffers(num_slots, ratio, coff * dim, device) if ratio else None
        self.index_state = _compressor_buffers(num_slots, 4, 2 * args.index_head_dim, device) if ratio == 4 else None

    def comp_state_of(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.comp_state[0][slot], self.comp_state[1][slot]

    def index_state_of(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.index_state[0][slot], self.index_state[1][slot]

    def reset_slot(self, slot: int) -> None:
        """A new request in `slot`: its unfinished windows are empty (zero projections, -inf scores)."""
        for state in (self.comp_state, self.index_state):
            if state is not None:
                state[0][slot].zero_()
                state[1][slot].fill_(float("-inf"))


def _compressor_buffers(num_slots: int, ratio: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    coff = 2 if ratio == 4 else 1
    kv = torch.zeros(num_slots, coff * ratio, width, device=device)
    return kv, torch.full_like(kv, float("-inf"))


class ModelKVCache:
    """Every layer's KV storage for up to `num_slots` running requests over a shared pool of pages. Requests hold
    pages through their PageTable (engine/cache/pool.py) and a window-ring slot from here."""

    def __init__(self, args, pool, num_slots: int, kv_dtype: str, device):
        self.pool, self.num_slots, self.kv_dtype = pool, num_slots, kv_dtype
        self.layers = [
            LayerKV(ratio, pool.num_pages, num_slots, args, pool.page_size, kv_dtype, device)
            for ratio in args.compress_ratios
        ]
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def take_slot(self) -> int:
        if not self._free_slots:
            raise RuntimeError(f"all {self.num_slots} request slots are in use")
        slot = self._free_slots.pop()
        for layer in self.layers:
            layer.reset_slot(slot)
        return slot

    def free_slot(self, slot: int) -> None:
        self._free_slots.append(slot)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache holds: rows, index keys and compressor states."""
        tensors = []
        for layer in self.layers:
            tensors += [layer.ring.storage, *(t.storage for t in (layer.comp, layer.index) if t is not None)]
            for state in (layer.comp_state, layer.index_state):
                tensors += list(state or ())
        return tensors

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())
