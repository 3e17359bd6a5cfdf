"""The one engine configuration. Every field is a `python -m engine serve` flag (its help is the field's `help`) and
appears in /server_info as applied."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.model.weight_formats import WEIGHT_FORMATS

DTYPES = ("auto", "float32", "bfloat16", "float16")
# Rows in the model's own dtype are what "auto" gives on the CPU, for exact results there.
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "bfloat16", "float16", "float32")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
# How attention is spread when tensor_parallel_size > 1 (the routed experts are split over every rank either way):
# data-parallel replicates the dense attention weights and gives each rank its own requests and KV pool (V4's one
# shared KV head means heads-split attention copies the whole KV to every rank); tensor-parallel splits the heads,
# every rank runs every request, and the KV is one copy per rank.
ATTENTION_MODES = ("data-parallel", "tensor-parallel")


def _field(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    model: str = field(metadata={"help": "the checkpoint directory (Hugging Face or official layout)"})
    served_model_name: str | None = _field(
        None, "the model id clients send and /v1/models lists (default: the model directory's name)"
    )
    dtype: str = _field("auto", f"weights and activations, one of {DTYPES}; auto = bfloat16 on CUDA, float32 on CPU")
    device: str = _field("auto", f"one of {DEVICES}; auto = CUDA when visible")
    context_length: int | None = _field(
        None, "the longest request, prompt plus output (default: the checkpoint's max_position_embeddings)"
    )
    max_num_batched_tokens: int = _field(8192, "tokens one step may run: decode tokens first, then prefill chunks")
    max_num_seqs: int = _field(16, "requests running at once")
    gpu_memory_utilization: float = _field(0.90, "fraction of the GPU's memory the engine may take, KV pool included")
    kv_cache_dtype: str = _field("auto", f"one of {KV_CACHE_DTYPES}; auto = fp8_e4m3 on CUDA, the model's dtype on CPU")
    num_kv_pages: int | None = _field(
        None,
        "KV pool size in pages (default: sized from GPU memory on CUDA; max_num_seqs full-context requests on CPU)",
    )
    cuda_graph_max_bs: int | None = _field(
        None, "largest decode batch captured as a CUDA graph (default: max_num_seqs, at most 16)"
    )
    enforce_eager: bool = _field(False, "never capture CUDA graphs: every decode step runs eagerly (for debugging)")
    prefix_cache: bool = _field(
        True,
        "reuse the KV of earlier requests' prompt prefixes a page (256 tokens) at a time, with snapshots of the "
        "window and compressor states (two a running request, counted in the pool's memory)",
    )
    tensor_parallel_size: int = _field(
        1,
        "GPUs (one process each) the model is spread over: routed experts split over all of them, attention as "
        "--attention says",
    )
    attention: str = _field(
        "data-parallel",
        f"one of {ATTENTION_MODES}, with tensor_parallel_size > 1: data-parallel = each GPU its own requests and KV "
        "pool (capacity, throughput), tensor-parallel = heads split, every GPU on every request (a request's latency)",
    )
    page_size: int = _field(256, "raw tokens per KV page: 256 tokens <-> 64 c4 rows <-> 2 c128 rows (only 256)")
    max_waiting_requests: int = _field(256, "requests that may wait for a running slot; beyond that HTTP 429")
    request_timeout_s: float | None = _field(
        None,
        "seconds a request may take from arrival to its last token; then it ends with what it has (default: no limit)",
    )
    shutdown_grace_s: float = _field(30.0, "after SIGTERM, seconds in-flight requests get to finish before abort")
    # The official checkpoint's FP8/FP4 rounding of KV nope dims and indexer q/k, as its inference code does;
    # False reproduces transformers, which omits it.
    quant_sim: bool = _field(True, "simulate the official FP8/FP4 activation rounding (off = transformers' math)")
    load_format: str = _field(
        "auto",
        f"one of {LOAD_FORMATS}; dummy = seeded random weights made on the device from the directory's config.json "
        "(benchmarks of a model's shape without its weights)",
    )
    weight_formats: str = _field(
        "as_stored",
        f"one of {WEIGHT_FORMATS}; as_stored keeps the formats config.json declares (the official checkpoint's FP8 "
        "dense linears and MXFP4 experts) in GPU memory, dequantized holds every weight in dtype",
    )
    seed: int = _field(0, "the engine's base random seed")
    host: str = _field("127.0.0.1", "address the HTTP server binds to")
    port: int = _field(30000, "port the HTTP server binds to")

    def __post_init__(self) -> None:
        if self.cuda_graph_max_bs is None and isinstance(self.max_num_seqs, int):
            self.cuda_graph_max_bs = min(16, self.max_num_seqs)
        for name in (
            "max_num_batched_tokens",
            "max_num_seqs",
            "cuda_graph_max_bs",
            "tensor_parallel_size",
            "page_size",
            "max_waiting_requests",
            "port",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        for name in ("context_length", "num_kv_pages"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 seconds, got {self.request_timeout_s!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0 seconds, got {self.shutdown_grace_s!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.weight_formats not in WEIGHT_FORMATS:
            raise ValueError(f"weight_formats must be one of {WEIGHT_FORMATS}, got {self.weight_formats!r}")
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
        if self.page_size != 256:  # the kernels read 64 c4 rows (index keys, main rows) and 2 c128 rows a page
            raise ValueError(
                f"page_size must be 256 (64 c4 rows a page, as the kernels read them), got {self.page_size}"
            )
        if self.attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {ATTENTION_MODES}, got {self.attention!r}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]
