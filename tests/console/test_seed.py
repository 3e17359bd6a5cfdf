"""Seeding from profiles/*.yaml: the field's exact envelopes, the V4-Flash profiles for 2 and 4 GPUs in both attention
modes, and the CPU demo, once, never over an operator's change."""

from __future__ import annotations

import json

import pytest
from litestar.testing import TestClient

from app.main import SEED_DIR

FIELD = {
    # name: (context_length, max_num_batched_tokens, max_num_seqs), reference/qualification.md §2.5
    "maxseq16-128k": (131_072, 8_192, 16),
    "maxseq16-650k": (650_000, 4_096, 16),
    "maxseq1-1m": (1_000_000, 2_048, 1),
    "maxseq4-1m": (1_000_000, 2_048, 4),
    "maxseq16-1m": (1_000_000, 2_048, 16),
}


MULTI_GPU = {
    # name: (tensor_parallel_size, attention, context_length, max_num_batched_tokens, max_num_seqs)
    "flash-2gpu-dp-128k": (2, "data-parallel", 131_072, 8_192, 16),
    "flash-2gpu-tp-128k": (2, "tensor-parallel", 131_072, 8_192, 16),
    "flash-4gpu-dp-1m": (4, "data-parallel", 1_048_576, 4_096, 8),
    "flash-4gpu-tp-1m": (4, "tensor-parallel", 1_048_576, 4_096, 8),
}


def test_seed_files_are_the_field_profiles_the_multi_gpu_profiles_and_the_cpu_demo():
    assert sorted(p.stem for p in SEED_DIR.glob("*.yaml")) == sorted([*FIELD, *MULTI_GPU, "cpu-demo"])


@pytest.mark.parametrize("name", FIELD)
def test_field_profiles_have_the_exact_values(client, admin, name):
    profile = client.get(f"/api/profiles/{name}", headers=admin).json()
    context_length, batched, seqs = FIELD[name]
    assert profile["context_length"] == context_length
    assert profile["max_num_batched_tokens"] == batched
    assert profile["max_num_seqs"] == seqs
    assert profile["cuda_graph_max_bs"] == seqs
    assert profile["gpu_memory_utilization"] == 0.975
    assert profile["kv_cache_dtype"] == "fp8_e4m3"
    assert profile["tensor_parallel_size"] == 2
    assert profile["model"] == "DeepSeek-V4-Flash"
    assert profile["parent"] is None and profile["created_by"] == "seed"
    # The engine's default attention and no GPUs named: the content they had before either setting existed.
    assert (profile["attention"], profile["gpus"]) == ("data-parallel", None)
    # On this CPU host: a state, not a refusal to seed.
    assert profile["state"]["blockers"] == ["weights missing", "more GPUs than this host has"]
    assert profile["state"]["tensor_parallel_available"] is False


@pytest.mark.parametrize("name", MULTI_GPU)
def test_multi_gpu_profiles_load_with_their_mode(client, admin, name):
    profile = client.get(f"/api/profiles/{name}", headers=admin).json()
    tp, attention, context_length, batched, seqs = MULTI_GPU[name]
    assert (profile["tensor_parallel_size"], profile["attention"], profile["gpus"]) == (tp, attention, None)
    assert (profile["context_length"], profile["max_num_batched_tokens"], profile["max_num_seqs"]) == (
        context_length,
        batched,
        seqs,
    )
    assert profile["cuda_graph_max_bs"] == seqs and profile["kv_cache_dtype"] == "fp8_e4m3"
    assert profile["model"] == "DeepSeek-V4-Flash" and profile["created_by"] == "seed"
    assert profile["state"]["blockers"] == ["weights missing", "more GPUs than this host has"]


def test_cpu_demo_is_seeded_with_weights_missing(client, admin):
    profile = client.get("/api/profiles/cpu-demo", headers=admin).json()
    expected = {
        "model": "demo",
        "dtype": "float32",
        "context_length": 4096,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 4,
        "cuda_graph_max_bs": 1,
        "gpu_memory_utilization": 0.5,
        "tensor_parallel_size": 1,
        "max_output_tokens": 256,
    }
    assert {k: profile[k] for k in expected} == expected
    assert profile["state"]["blockers"] == ["weights missing"]
    assert profile["state"]["weights_present"] is False


def test_weights_present_once_the_checkpoint_exists(client, admin, data_dir):
    demo = data_dir / "models" / "demo"
    demo.mkdir(parents=True)
    (demo / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    (demo / "model.safetensors").write_bytes(b"")
    state = client.get("/api/profiles/cpu-demo", headers=admin).json()["state"]
    assert state["weights_present"] is True and state["blockers"] == []
    assert state["model_max_context"] == 4096


def test_seeding_is_idempotent_and_keeps_operator_changes(make_app, admin, data_dir):
    with TestClient(make_app()) as first:
        names = [p["name"] for p in first.get("/api/profiles", headers=admin).json()]
        changed = first.patch("/api/profiles/cpu-demo", json={"max_output_tokens": 128}, headers=admin)
        assert changed.status_code == 200, changed.text
        assert first.post("/api/profiles/maxseq16-128k/retire", headers=admin).status_code == 200
    with TestClient(make_app()) as second:
        assert sorted(p["name"] for p in second.get("/api/profiles", headers=admin).json()) == sorted(names)
        assert second.get("/api/profiles/cpu-demo", headers=admin).json()["max_output_tokens"] == 128
        assert second.get("/api/profiles/maxseq16-128k", headers=admin).json()["state"]["retired"] is True
        seeded = second.get("/api/audit", params={"action": "profile.seed"}, headers=admin).json()
    assert len(seeded) == len(names) == 10
    assert {row["after"]["source"] for row in seeded} == {f"profiles/{n}.yaml" for n in names}
