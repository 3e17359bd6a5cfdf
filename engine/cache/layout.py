"""What the KV cache stores and how many bytes it takes (reference §11).

A page holds 256 raw tokens' worth of compressed state, addressed by one page id in every layer:
64 c4 rows (main KV row + indexer key row) and 2 c128 rows. Each request also owns fixed state outside the pages:
a 128-slot sliding-window ring of main KV rows in every layer and the compressors' unfinished windows (fp32).

Row formats (engine/kernels/kv_format.py): main KV fp8 = 448 e4m3 nope + 64 bf16 RoPE + 7 ue8m0 scales + 1 pad =
584 B; bf16 = 1024 B. Indexer key fp8 = 128 e4m3 + 4 B fp32 scale = 132 B; bf16 = 256 B.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kernels.kv_format import index_row_bytes, main_row_bytes
from engine.model.args import ModelArgs


@dataclass(frozen=True)
class KVLayout:
    page_size: int
    kv_dtype: str  # "fp8_e4m3", or a float dtype name whose rows keep every channel at that width
    head_dim: int
    rope_dim: int
    index_head_dim: int
    window: int
    n_c4_layers: int
    n_c128_layers: int
    n_window_layers: int  # every layer has a window ring, MTP layers included

    @classmethod
    def for_model(cls, args: ModelArgs, page_size: int, kv_dtype: str) -> KVLayout:
        ratios = args.compress_ratios
        if page_size % 128:
            raise ValueError(f"page_size must be a multiple of 128, got {page_size}")
        return cls(
            page_size=page_size,
            kv_dtype=kv_dtype,
            head_dim=args.head_dim,
            rope_dim=args.qk_rope_head_dim,
            index_head_dim=args.index_head_dim,
            window=args.sliding_window,
            n_c4_layers=sum(r == 4 for r in ratios),
            n_c128_layers=sum(r == 128 for r in ratios),
            n_window_layers=len(ratios),
        )

    @property
    def main_row_bytes(self) -> int:
        if self.kv_dtype == "fp8_e4m3":
            return main_row_bytes(self.head_dim, self.rope_dim)
        return self._element_bytes * self.head_dim

    @property
    def index_row_bytes(self) -> int:
        if self.kv_dtype == "fp8_e4m3":
            return index_row_bytes(self.index_head_dim)
        return self._element_bytes * self.index_head_dim

    @property
    def _element_bytes(self) -> int:
        return {"bfloat16": 2, "float16": 2, "float32": 4}[self.kv_dtype]

    @property
    def bytes_per_page(self) -> int:
        c4 = (self.page_size // 4) * (self.main_row_bytes + self.index_row_bytes)
        c128 = (self.page_size // 128) * self.main_row_bytes
        return self.n_c4_layers * c4 + self.n_c128_layers * c128

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_page / self.page_size

    @property
    def per_sequence_state_bytes(self) -> int:
        """Window rings plus fp32 compressor states (kv and score): c4 [8, 2d] main and [8, 2*128] indexer,
        c128 [128, d]."""
        ring = self.n_window_layers * self.window * self.main_row_bytes
        c4 = 2 * 4 * (8 * 2 * self.head_dim + 8 * 2 * self.index_head_dim)
        c128 = 2 * 4 * (128 * self.head_dim)
        return ring + self.n_c4_layers * c4 + self.n_c128_layers * c128

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
