"""Every layer's KV storage over the page pool, allocated in the serving row formats of engine/kernels/kv_format.py
(which also holds their codec): main rows (window ring, c4 and c128 compressed rows) and index keys (c4 layers)."""

from __future__ import annotations

import torch

from engine.kernels.kv_format import (
    INDEX_ROWS,
    index_row_bytes,
    index_scales,
    index_values,
    main_row_bytes,
    read_index_keys,
    read_main_rows,
    write_index_keys,
)
from engine.kernels.kv_rows import write_main_rows


class MainRows:
    """One layer's main KV rows in pages."""

    def __init__(self, num_pages: int, rows_per_page: int, head_dim: int, rope_dim: int, dtype: str, device):
        self.num_pages, self.rows_per_page, self.head_dim, self.rope_dim = num_pages, rows_per_page, head_dim, rope_dim
        self.fp8 = dtype == "fp8_e4m3"
        if self.fp8:
            row_bytes = main_row_bytes(head_dim, rope_dim)
            self.storage = torch.zeros(num_pages, rows_per_page * row_bytes, dtype=torch.uint8, device=device)
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

    def copy_pages(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Pages `src` [N] into pages `dst` [N] (a window ring's page is a request slot)."""
        pages = self.storage.view(self.num_pages, -1)
        pages.index_copy_(0, dst, pages.index_select(0, src))


class IndexKeys:
    """One c4 layer's indexer keys in pages of INDEX_ROWS rows."""

    rows_per_page = INDEX_ROWS

    def __init__(self, num_pages: int, dim: int, dtype: str, device):
        self.dim, self.fp8 = dim, dtype == "fp8_e4m3"
        if self.fp8:
            self.storage = torch.zeros(num_pages, INDEX_ROWS * index_row_bytes(dim), dtype=torch.uint8, device=device)
        else:
            self.storage = torch.zeros(num_pages * INDEX_ROWS, dim, dtype=getattr(torch, dtype), device=device)

    @property
    def values(self) -> torch.Tensor:
        return index_values(self.storage, self.dim)

    @property
    def scales(self) -> torch.Tensor | None:
        return index_scales(self.storage, self.dim)

    def write(self, slots: torch.Tensor, keys: torch.Tensor) -> None:
        write_index_keys(self.storage, slots, keys)

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return read_index_keys(self.storage, slots, self.dim)


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

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slots `src` into slots `dst`: window rings and unfinished windows (a snapshot taken or restored)."""
        self.ring.copy_pages(src, dst)
        for state in (self.comp_state, self.index_state):
            for tensor in state or ():
                tensor.index_copy_(0, dst, tensor.index_select(0, src))


def _compressor_buffers(num_slots: int, ratio: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    coff = 2 if ratio == 4 else 1
    kv = torch.zeros(num_slots, coff * ratio, width, device=device)
    return kv, torch.full_like(kv, float("-inf"))


def kv_dtype_for(kv_cache_dtype: str, device: torch.device, model_dtype: torch.dtype) -> str:
    """The rows a cache stores: "auto" is FP8 on CUDA, the model's own dtype elsewhere (exact on the CPU)."""
    if kv_cache_dtype != "auto":
        return kv_cache_dtype
    return "fp8_e4m3" if device.type == "cuda" else str(model_dtype).removeprefix("torch.")


class ModelKVCache:
    """Every layer's KV storage: `num_pages` pages of `page_size` tokens and `num_slots` request slots. Which pages
    and which slot a request holds is the block manager's business (engine/cache/block_manager.py); a request new
    to a slot has it reset here first."""

    def __init__(self, args, num_pages: int, page_size: int, num_slots: int, kv_dtype: str, device):
        self.num_pages, self.page_size, self.num_slots, self.kv_dtype = num_pages, page_size, num_slots, kv_dtype
        self.layers = [
            LayerKV(ratio, num_pages, num_slots, args, page_size, kv_dtype, device) for ratio in args.compress_ratios
        ]

    def reset_slot(self, slot: int) -> None:
        for layer in self.layers:
            layer.reset_slot(slot)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Each slot of `src` [N] into the slot of `dst` [N] at the same place, in every layer (on the device)."""
        for layer in self.layers:
            layer.copy_slots(src, dst)

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
