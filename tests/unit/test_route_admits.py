"""How many agent requests the route holds for the serving engine: max_num_seqs running on each data-parallel GPU
(each has a scheduler of its own), once for tensor-parallel or one GPU, plus the one waiting queue."""

from __future__ import annotations

from app.profiles.models import Profile
from app.route.proxy import engine_admits


def profile(**changes) -> Profile:
    fields = {"name": "p", "rationale": "r", "model": "m", "dtype": "auto", "context_length": 4096}
    fields |= {"max_num_batched_tokens": 512, "max_num_seqs": 16, "gpu_memory_utilization": 0.9}
    fields |= {"kv_cache_dtype": "auto", "cuda_graph_max_bs": 16, "tensor_parallel_size": 1, "max_output_tokens": 256}
    return Profile(**(fields | changes), content_hash="h", created_by="t")


def test_one_gpu_and_tensor_parallel_admit_max_num_seqs_once():
    applied = {"max_num_seqs": 16, "max_waiting_requests": 4, "tensor_parallel_size": 1, "attention": "data-parallel"}
    assert engine_admits(applied, profile()) == (20, "max_num_seqs + max_waiting_requests")
    tp = {**applied, "tensor_parallel_size": 2, "attention": "tensor-parallel"}
    assert engine_admits(tp, profile(tensor_parallel_size=2, attention="tensor-parallel"))[0] == 20


def test_data_parallel_admits_max_num_seqs_on_each_gpu():
    applied = {"max_num_seqs": 8, "max_waiting_requests": 4, "tensor_parallel_size": 4, "attention": "data-parallel"}
    assert engine_admits(applied, profile(tensor_parallel_size=4)) == (
        36,
        "max_num_seqs × 4 data-parallel GPUs + max_waiting_requests",
    )
    # An engine that does not report the mode (older builds): the profile's.
    assert engine_admits({"max_num_seqs": 8}, profile(tensor_parallel_size=2))[0] == 16
    assert engine_admits({"max_num_seqs": 8}, profile(tensor_parallel_size=2, attention="tensor-parallel"))[0] == 8
