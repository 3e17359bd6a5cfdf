"""Per-request decode state and the flattened batch the model runs on (reference §5.2, §11.1).

The plain-torch path keeps each request's state as dense tensors that grow with the request's actual length: a
sliding-window tail, each compressor's unfinished window, and the compressed rows emitted so far. The paged cache
(`engine/cache/`) stores the same things in fixed-size pages for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """One compressor's progress through a request (main KV or indexer keys)."""

    # Projected kv / gate score (with the position bias added) of tokens in the window not yet closed: [r, coff*d].
    pending_kv: torch.Tensor
    pending_score: torch.Tensor
    # Overlapping (ratio 4) compressors only: the first-half projections of the last closed window, which the
    # next window pools together with its own second half: [ratio, d]; score -inf before the first window closes.
    prev_kv: torch.Tensor | None
    prev_score: torch.Tensor | None
    # Compressed entries emitted so far, after norm, RoPE and (optional) quantisation simulation: [n, d].
    rows: torch.Tensor

    @classmethod
    def empty(cls, ratio: int, dim: int, device: torch.device, dtype: torch.dtype) -> CompressorState:
        coff = 2 if ratio == 4 else 1
        f32 = dict(device=device, dtype=torch.float32)
        return cls(
            pending_kv=torch.empty(0, coff * dim, **f32),
            pending_score=torch.empty(0, coff * dim, **f32),
            prev_kv=torch.zeros(ratio, dim, **f32) if coff == 2 else None,
            prev_score=torch.full((ratio, dim), float("-inf"), **f32) if coff == 2 else None,
            rows=torch.empty(0, dim, device=device, dtype=dtype),
        )


@dataclass
class LayerState:
    # The last (sliding_window - 1) KV rows: what the next token's window needs besides itself.
    window: torch.Tensor
    compressor: CompressorState | None = None
    indexer: CompressorState | None = None


@dataclass
class SequenceState:
    """Everything the model remembers about one request; `num_tokens` positions have been processed."""

    layers: list[LayerState]
    num_tokens: int = 0
    # Last processed position's pre-head residual streams [hc, D]: the MTP layer's input for drafting.
    last_streams: torch.Tensor | None = None


@dataclass
class ForwardBatch:
    """Tokens of several requests flattened into one axis: request i owns rows [starts[i], starts[i] + lens[i])."""

    input_ids: torch.Tensor  # [N]
    positions: torch.Tensor  # [N]
    states: list[SequenceState]
    lens: list[int]
    starts: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.starts = []
        offset = 0
        for n in self.lens:
            self.starts.append(offset)
            offset += n

    def rows(self, i: int) -> slice:
        return slice(self.starts[i], self.starts[i] + self.lens[i])
