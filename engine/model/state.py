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

    # The unfinished windows' projections in the official layout (engine/kernels/compressor.py): kv and gate score
    # with the position bias added, [coff * ratio, coff * dim] fp32; scores start at -inf.
    kv: torch.Tensor
    score: torch.Tensor
    # Compressed entries emitted so far, after norm, RoPE and (optional) quantisation simulation: [n, dim].
    rows: torch.Tensor

    @classmethod
    def empty(cls, ratio: int, dim: int, device: torch.device, dtype: torch.dtype) -> CompressorState:
        coff = 2 if ratio == 4 else 1
        shape = (coff * ratio, coff * dim)
        return cls(
            kv=torch.zeros(shape, device=device, dtype=torch.float32),
            score=torch.full(shape, float("-inf"), device=device, dtype=torch.float32),
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
