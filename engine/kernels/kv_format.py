"""The paged KV cache's row formats (reference §11.2), in one place: their byte layouts and the plain-torch codec
that reads and writes them. The cache allocates storage in these formats (engine/cache/kv_cache.py) and counts its
bytes from them (engine/cache/layout.py); kernels take the storage tensors and these constants.

Main rows (window ring, c4 and c128 compressed rows), `rows_per_page` rows a page:
- bfloat16 (or float32, for fp32 models on the CPU): `[pages * rows_per_page, head_dim]`;
- fp8_e4m3: `[pages, rows_per_page * main_row_bytes]` bytes. A page holds its rows' data first (each the nope
  channels in e4m3, then the RoPE channels in bf16: 448 + 128 = 576 B for V4-Flash), then their scales (one ue8m0
  byte per 64 nope channels, padded to MAIN_SCALE_BYTES: 7 + 1 = 8, which the attention kernel loads as one int64).
Index keys (c4 layers), INDEX_ROWS rows a page:
- bfloat16 / float32: `[pages * INDEX_ROWS, index_head_dim]`;
- fp8_e4m3: `[pages, INDEX_ROWS * (index_head_dim + INDEX_SCALE_BYTES)]` bytes, block-major: the page's e4m3 values,
  then one fp32 scale a row.
"""

from __future__ import annotations

import torch

from engine.kernels.quant import FP8_MAX

SCALE_BLOCK = 64  # nope channels per ue8m0 scale of a main row
MAIN_SCALE_BYTES = 8
INDEX_ROWS = 64
INDEX_SCALE_BYTES = 4  # one fp32 scale a row


def main_data_bytes(head_dim: int, rope_dim: int) -> int:
    """An fp8 main row's values: e4m3 nope channels, then bf16 RoPE channels."""
    return head_dim - rope_dim + 2 * rope_dim


def main_row_bytes(head_dim: int, rope_dim: int) -> int:
    nope = head_dim - rope_dim
    if nope % SCALE_BLOCK or nope // SCALE_BLOCK > MAIN_SCALE_BYTES:
        raise ValueError(f"fp8 main rows need nope channels in 1 to {MAIN_SCALE_BYTES} blocks of {SCALE_BLOCK}")
    return main_data_bytes(head_dim, rope_dim) + MAIN_SCALE_BYTES


def index_row_bytes(dim: int) -> int:
    return dim + INDEX_SCALE_BYTES


def read_main_rows(storage: torch.Tensor, slots: torch.Tensor, rows_per_page: int, head_dim: int, rope_dim: int):
    """Rows at physical `slots` of main-row storage (plain rows, or fp8 pages when the storage is bytes), fp32."""
    if storage.dtype != torch.uint8:  # index_select: its backward (training's) adds, advanced indexing's sorts
        return storage.index_select(0, slots.long()).float()
    nope, data_bytes = head_dim - rope_dim, main_data_bytes(head_dim, rope_dim)
    slots = slots.long()
    page, row = slots // rows_per_page, slots % rows_per_page
    raw = storage[page[:, None], (row * data_bytes)[:, None] + torch.arange(data_bytes, device=slots.device)]
    values = raw[:, :nope].contiguous().view(torch.float8_e4m3fn).float()
    rope = raw[:, nope:].contiguous().view(torch.bfloat16).float()
    scale_at = rows_per_page * data_bytes + row * MAIN_SCALE_BYTES
    exps = storage[page[:, None], scale_at[:, None] + torch.arange(nope // SCALE_BLOCK, device=slots.device)]
    scale = torch.exp2(exps.float() - 127).repeat_interleave(SCALE_BLOCK, dim=1)
    return torch.cat([values * scale, rope], dim=1)


def main_page_rows(storage: torch.Tensor, page: int, rows_per_page: int, head_dim: int, rope_dim: int):
    """Page `page` of fp8 main-row storage as byte views (data [rows_per_page, data bytes], scales [rows_per_page,
    MAIN_SCALE_BYTES]): a row copied through both is copied bit for bit."""
    data_bytes = main_data_bytes(head_dim, rope_dim)
    split = rows_per_page * data_bytes
    return storage[page, :split].view(rows_per_page, data_bytes), storage[page, split:].view(rows_per_page, -1)


def index_values(storage: torch.Tensor, dim: int) -> torch.Tensor:
    """[pages, INDEX_ROWS, dim] view of index-key storage, indexed as page * stride(0) + row * stride(1)."""
    if storage.dtype == torch.uint8:
        return storage[:, : INDEX_ROWS * dim].view(torch.float8_e4m3fn).unflatten(1, (INDEX_ROWS, dim))
    return storage.view(-1, INDEX_ROWS, dim)


def index_scales(storage: torch.Tensor, dim: int) -> torch.Tensor | None:
    """[pages, INDEX_ROWS] fp32 row scales of fp8 index-key storage; None for plain rows."""
    return storage[:, INDEX_ROWS * dim :].view(torch.float32) if storage.dtype == torch.uint8 else None


def write_index_keys(storage: torch.Tensor, slots: torch.Tensor, keys: torch.Tensor) -> None:
    """keys [N, dim] -> physical `slots` [N]; fp8 rows get the power-of-two scale of their largest value."""
    dim = keys.shape[-1]
    values = index_values(storage, dim)
    page, row = slots.long() // INDEX_ROWS, slots.long() % INDEX_ROWS
    if storage.dtype != torch.uint8:
        values[page, row] = keys.to(storage.dtype)
        return
    scale = torch.exp2(torch.ceil(torch.log2(keys.float().abs().amax(-1).clamp_min(1e-30) / FP8_MAX)))
    values[page, row] = (keys.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    index_scales(storage, dim)[page, row] = scale


def read_index_keys(storage: torch.Tensor, slots: torch.Tensor, dim: int) -> torch.Tensor:
    if storage.dtype != torch.uint8:  # rows in slot order, [pages * INDEX_ROWS, dim]; as read_main_rows
        return storage.index_select(0, slots.long()).float()
    page, row = slots.long() // INDEX_ROWS, slots.long() % INDEX_ROWS
    keys = index_values(storage, dim)[page, row].float()
    scales = index_scales(storage, dim)
    return keys if scales is None else keys * scales[page, row][:, None]
