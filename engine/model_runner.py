"""Loads the model once and runs one scheduled step: build the flattened batch, forward, logits, sample."""

from __future__ import annotations

from collections.abc import Callable

import structlog
import torch

from engine.config import EngineConfig
from engine.model.loader import load_model
from engine.model.state import ForwardBatch
from engine.sampler import sample
from engine.scheduler import ScheduledWork
from engine.sequence import TokenLogprob

log = structlog.get_logger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(config: EngineConfig) -> torch.device:
    if config.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if config.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was asked for but no CUDA device is visible")
    return torch.device(config.device)


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    if config.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[config.dtype]


class ModelRunner:
    def __init__(self, config: EngineConfig, progress: Callable[[int, int], None] | None = None):
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        self.model = load_model(config.model, self.dtype, self.device, config.quant_sim, progress)

    @torch.inference_mode()
    def run(self, work: list[ScheduledWork]) -> list[tuple[int, TokenLogprob | None] | None]:
        """Advance each scheduled request by its tokens; a sampled token for those whose prompt is now complete."""
        ids, positions, states, lens = [], [], [], []
        for item in work:
            seq = item.seq
            if seq.state is None:
                seq.state = self.model.new_state()
            start = seq.num_computed
            ids.extend(seq.token_ids[start : start + item.num_tokens])
            positions.extend(range(start, start + item.num_tokens))
            states.append(seq.state)
            lens.append(item.num_tokens)
        batch = ForwardBatch(
            torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), states, lens
        )
        streams = self.model(batch)
        sampling = [item.completes_prompt for item in work]
        last_rows = [batch.starts[i] + lens[i] - 1 for i, s in enumerate(sampling) if s]
        logits = self.model.logits(streams[last_rows]).cpu() if last_rows else None
        results, row = [], 0
        for item, samples in zip(work, sampling, strict=True):
            item.seq.num_computed += item.num_tokens
            if samples:
                results.append(sample(logits[row], item.seq.params, item.seq.generator))
                row += 1
            else:
                results.append(None)
        return results
