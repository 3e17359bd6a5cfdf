"""The one engine configuration. Every field is a `python -m engine serve` flag and appears in /server_info."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
DEVICES = ("auto", "cpu", "cuda")


@dataclass
class EngineConfig:
    model: str
    served_model_name: str | None = None
    # "auto": bfloat16 on CUDA, float32 on CPU (where bf16 matmuls are slow and parity wants fp32).
    dtype: str = "auto"
    device: str = "auto"
    # None: the checkpoint's max_position_embeddings.
    context_length: int | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 16
    gpu_memory_utilization: float = 0.90
    kv_cache_dtype: str = "auto"
    cuda_graph_max_bs: int = 16
    tensor_parallel_size: int = 1
    # Raw tokens per KV page: 256 tokens <-> 64 c4 rows <-> 2 c128 rows.
    page_size: int = 256
    # Simulate the official checkpoint's FP8/FP4 rounding (KV nope dims, indexer q/k with Hadamard), as the
    # official inference code does. False reproduces transformers, which omits it.
    quant_sim: bool = True
    seed: int = 0
    host: str = "127.0.0.1"
    port: int = 30000

    def __post_init__(self) -> None:
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "cuda_graph_max_bs",
            "tensor_parallel_size",
            "page_size",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.context_length is not None and self.context_length < 1:
            raise ValueError(f"context_length must be a positive integer, got {self.context_length!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if not 0.0 < self.gpu_memory_utilization < 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1), got {self.gpu_memory_utilization!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs})"
            )
        if self.cuda_graph_max_bs > self.max_num_seqs:
            raise ValueError(
                f"cuda_graph_max_bs ({self.cuda_graph_max_bs}) must be <= max_num_seqs ({self.max_num_seqs})"
            )
        if self.page_size % 128:
            raise ValueError(f"page_size must be a multiple of 128 (the c128 compression ratio), got {self.page_size}")
        if self.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size must be 1: tensor parallelism is not implemented yet")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
