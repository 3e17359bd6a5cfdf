"""The profile API: create, view, make a child, diff, change, retire; every rule refused with the field and the
limit named; nothing written by a refused request; immutability once evidence exists."""

from __future__ import annotations

import json
import sqlite3

import pytest

NEW = {
    "name": "tiny-root",
    "model": "tiny",
    "dtype": "float32",
    "context_length": 2048,
    "max_num_batched_tokens": 256,
    "max_num_seqs": 2,
    "cuda_graph_max_bs": 1,
    "max_output_tokens": 128,
}


def row_counts(data_dir) -> tuple[int, int]:
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        return (
            conn.execute("SELECT count(*) FROM profile").fetchone()[0],
            conn.execute("SELECT count(*) FROM audit").fetchone()[0],
        )


def add_evidence(data_dir, profile: str) -> None:
    """What a qualification run will do: store an observation about the profile."""
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        conn.execute(
            "INSERT INTO evidence (profile_id, gate, created_at, payload) "
            "SELECT id, 'smoke', '2025-01-01 00:00:00', ? FROM profile WHERE name = ?",
            (json.dumps({"passed": True}), profile),
        )


def test_create_and_view_a_root_profile(client, operator):
    response = client.post("/api/profiles", json={**NEW, "rationale": "a smaller demo"}, headers=operator)
    assert response.status_code == 201, response.text
    created = response.json()
    assert created["name"] == "tiny-root" and created["parent"] is None and created["created_by"] == "otto"
    assert created["gpu_memory_utilization"] == 0.9 and created["kv_cache_dtype"] == "auto"  # defaults
    assert len(created["content_hash"]) == 64
    assert created["state"]["blockers"] == ["weights missing"]
    assert client.get("/api/profiles/tiny-root", headers=operator).json() == created
    listed = {p["name"]: p for p in client.get("/api/profiles", headers=operator).json()}
    assert listed["tiny-root"] == created


def test_child_copies_the_parent_and_shows_the_diff(client, operator):
    response = client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": "cpu-demo-2k", "rationale": "half the context", "context_length": 2048},
        headers=operator,
    )
    assert response.status_code == 201, response.text
    child = response.json()
    parent = client.get("/api/profiles/cpu-demo", headers=operator).json()
    assert child["parent"] == "cpu-demo" and child["rationale"] == "half the context"
    assert child["diff"] == [{"field": "context_length", "parent": 4096, "value": 2048}]
    assert child["warnings"] == []
    for field in ("model", "dtype", "max_num_seqs", "max_num_batched_tokens", "max_output_tokens"):
        assert child[field] == parent[field]
    assert child["content_hash"] != parent["content_hash"]
    assert parent["children"] == ["cpu-demo-2k"]
    assert child["state"]["evidence_count"] == 0


def test_child_with_more_than_one_change_warns(client, operator):
    response = client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": "cpu-demo-wide", "rationale": "two at once", "max_num_seqs": 2, "dtype": "bfloat16"},
        headers=operator,
    )
    assert response.status_code == 201
    (warning,) = response.json()["warnings"]
    assert "2 settings differ from the parent (dtype, max_num_seqs)" in warning


@pytest.mark.parametrize(
    ("body", "field", "limit"),
    [
        ({"context_length": 0}, "context_length", "at least 1"),
        ({"max_num_seqs": 0}, "max_num_seqs", "at least 1"),
        ({"max_num_batched_tokens": 2}, "max_num_batched_tokens", "at least max_num_seqs (4)"),
        ({"cuda_graph_max_bs": 8}, "cuda_graph_max_bs", "at most max_num_seqs (4)"),
        ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization", "greater than 0 and less than 1"),
        ({"gpu_memory_utilization": 0}, "gpu_memory_utilization", "greater than 0 and less than 1"),
        ({"context_length": 1_048_577, "max_output_tokens": 256}, "context_length", "at most 1048576"),
        # More engine processes than this (CPU) host has GPUs.
        ({"tensor_parallel_size": 2}, "tensor_parallel_size", "must be at most 1 (one engine process per GPU"),
        ({"attention": "pipeline"}, "attention", "one of data-parallel, tensor-parallel"),
        ({"gpus": [0, 1]}, "gpus", "gpus must list tensor_parallel_size (1) GPU, one per engine process, got 2"),
        ({"gpus": [0]}, "gpus", "gpus must name GPUs this host shows (this host shows no GPU: no NVIDIA GPU"),
        ({"max_output_tokens": 5000}, "max_output_tokens", "at most context_length (2048)"),
        ({"dtype": "fp64"}, "dtype", "one of auto, float32, bfloat16, float16"),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype", "one of auto, bfloat16, fp8_e4m3"),
        ({"model": "../etc"}, "model", "relative path under FLASHGATE_MODELS_DIR"),
        ({"engine_extras": {"context_length": 1}}, "engine_extras.context_length", "is a profile field"),
        # argparse took `--mod` for `--model`: weights from outside the models directory under this fingerprint.
        ({"engine_extras": {"mod": "/tmp/elsewhere"}}, "engine_extras.mod", "'mod' is not an engine option"),
        ({"engine_extras": {"model=/tmp/x": True}}, "engine_extras.model=/tmp/x", "must not hold '='"),
        ({"engine_extras": {"port": 1}}, "engine_extras.port", "the console sets port"),
        ({"engine_extras": {"num-kv-pages": 8}}, "engine_extras.num-kv-pages", "did you mean 'num_kv_pages'"),
        ({"engine_extras": {"num_kv_pages": "8"}}, "engine_extras.num_kv_pages", "must be an integer or null"),
        ({"engine_extras": {"quant_sim": 1}}, "engine_extras.quant_sim", "must be true or false"),
        ({"name": "Not A Slug"}, "name", "lowercase slug of 1 to 63 characters"),
        ({"rationale": "  "}, "rationale", "rationale is required"),
        ({"context_length": 4096}, "settings", "at least one setting"),
    ],
)
def test_every_rule_is_a_422_naming_field_and_limit_and_writes_nothing(client, operator, data_dir, body, field, limit):
    before = row_counts(data_dir)
    request = {"name": "cpu-demo-bad", "rationale": "testing a rule", "context_length": 2048, **body}
    response = client.post("/api/profiles/cpu-demo/children", json=request, headers=operator)
    assert response.status_code == 422, response.text
    error = response.json()
    assert [e["field"] for e in error["extra"]] == [field]
    assert limit in error["extra"][0]["message"] and limit in error["detail"]
    if field != "settings":  # a rule about the whole child, not one field
        assert error["detail"].startswith(field) or f"; {field}" in error["detail"]
    assert row_counts(data_dir) == before


def test_context_length_is_limited_by_the_model_config(client, operator, data_dir):
    demo = data_dir / "models" / "demo"
    demo.mkdir(parents=True)
    (demo / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    response = client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": "cpu-demo-8k", "rationale": "longer", "context_length": 8192},
        headers=operator,
    )
    assert response.status_code == 422
    assert "context_length must be at most 4096 (the model's maximum context), got 8192" in response.json()["detail"]


def test_a_child_of_a_two_gpu_field_profile_must_choose_one_gpu(client, operator):
    body = {"name": "maxseq16-650k-tp1", "rationale": "one GPU", "tensor_parallel_size": 1}
    response = client.post("/api/profiles/maxseq16-650k/children", json=body, headers=operator)
    assert response.status_code == 201, response.text
    assert response.json()["state"]["blockers"] == ["weights missing"]


def test_wrong_types_and_unknown_fields_are_400_naming_the_field(client, operator, data_dir):
    before = row_counts(data_dir)
    response = client.post("/api/profiles", json={**NEW, "context_length": "long"}, headers=operator)
    assert response.status_code == 400 and "context_length" in response.text
    response = client.post("/api/profiles", json={**NEW, "max_num_seq": 4}, headers=operator)
    assert response.status_code == 400 and "max_num_seq" in response.text
    assert row_counts(data_dir) == before


def test_names_are_unique(client, operator, data_dir):
    assert client.post("/api/profiles", json=NEW, headers=operator).status_code == 201
    before = row_counts(data_dir)
    for response in (
        client.post("/api/profiles", json=NEW, headers=operator),
        client.post(
            "/api/profiles/cpu-demo/children",
            json={"name": "tiny-root", "rationale": "clash", "max_num_seqs": 2},
            headers=operator,
        ),
    ):
        assert response.status_code == 409 and "already exists" in response.json()["detail"]
    # Among other errors, the taken name is one more field in the one 422 that names them all.
    response = client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": "tiny-root", "rationale": "", "max_num_seqs": 0},
        headers=operator,
    )
    assert response.status_code == 422
    assert {e["field"] for e in response.json()["extra"]} >= {"name", "rationale", "max_num_seqs"}
    assert row_counts(data_dir) == before


def test_unknown_profile_is_404(client, operator):
    assert client.get("/api/profiles/nope", headers=operator).status_code == 404
    body = {"name": "x", "rationale": "y", "max_num_seqs": 1}
    assert client.post("/api/profiles/nope/children", json=body, headers=operator).status_code == 404


def test_change_in_place_until_evidence_exists_then_409(client, operator, data_dir):
    changed = client.patch("/api/profiles/cpu-demo", json={"max_output_tokens": 128}, headers=operator)
    assert changed.status_code == 200 and changed.json()["max_output_tokens"] == 128
    refused = client.patch("/api/profiles/cpu-demo", json={"max_num_seqs": 0}, headers=operator)
    assert refused.status_code == 422 and "max_num_seqs" in refused.json()["detail"]

    add_evidence(data_dir, "cpu-demo")
    profile = client.get("/api/profiles/cpu-demo", headers=operator).json()
    assert profile["state"]["immutable"] is True and profile["state"]["evidence_count"] == 1
    before = row_counts(data_dir)
    response = client.patch("/api/profiles/cpu-demo", json={"max_output_tokens": 64}, headers=operator)
    assert response.status_code == 409
    assert "immutable" in response.json()["detail"] and "make a child" in response.json()["detail"]
    assert row_counts(data_dir) == before
    assert client.get("/api/profiles/cpu-demo", headers=operator).json()["max_output_tokens"] == 128

    # Editing means making a child, and evidence does not carry over to it.
    child = client.post(
        "/api/profiles/cpu-demo/children",
        json={"name": "cpu-demo-64", "rationale": "shorter answers", "max_output_tokens": 64},
        headers=operator,
    )
    assert child.status_code == 201
    assert child.json()["state"]["evidence_count"] == 0 and child.json()["state"]["immutable"] is False


def test_retire(client, operator):
    response = client.post("/api/profiles/maxseq1-1m/retire", headers=operator)
    assert response.status_code == 200
    state = response.json()
    assert state["state"]["retired"] is True and state["retired_by"] == "otto" and state["retired_at"]
    again = client.post("/api/profiles/maxseq1-1m/retire", headers=operator)
    assert again.status_code == 409 and "already retired" in again.json()["detail"]
    frozen = client.patch("/api/profiles/maxseq1-1m", json={"max_num_seqs": 2}, headers=operator)
    assert frozen.status_code == 409 and "retired" in frozen.json()["detail"]
    names = [p["name"] for p in client.get("/api/profiles", headers=operator).json()]
    assert names[-1] == "maxseq1-1m"  # retired profiles are listed last, still on record


@pytest.mark.parametrize("role", ["production", "rollback"])
def test_a_profile_the_route_starts_cannot_be_retired(client, operator, data_dir, role, sign_in):
    # Retired, production could neither restart nor resume (and a rollback target could not be rolled back to).
    with sqlite3.connect(data_dir / "flashgate.sqlite3") as conn:
        (profile_id,) = conn.execute("SELECT id FROM profile WHERE name = 'cpu-demo'").fetchone()
        conn.execute(
            f"INSERT INTO route (alias, {role}_id, updated_at, updated_by)"
            " VALUES ('production', ?, datetime('now'), 'test')",
            (profile_id,),
        )
    before = row_counts(data_dir)
    refused = client.post("/api/profiles/cpu-demo/retire", headers=operator)
    assert refused.status_code == 409 and f"'cpu-demo' holds the {role} role" in refused.json()["detail"]
    assert row_counts(data_dir) == before
    assert client.get("/api/profiles/cpu-demo", headers=operator).json()["state"]["retired"] is False
    sign_in("otto", operator["Authorization"].removeprefix("Bearer "))
    page = client.get("/profiles/cpu-demo").text
    assert f"It holds the {role} role" in page and 'action="/profiles/cpu-demo/retire"' not in page


def test_production_route_is_empty_and_promotion_waits_for_qualification(client, operator, viewer):
    assert client.get("/api/route/production", headers=viewer).json() is None
    response = client.put("/api/route/production", json={"profile": "cpu-demo", "reason": "go"}, headers=operator)
    assert response.status_code == 409
    assert "'cpu-demo' is not approved" in response.json()["detail"]


def test_openapi_lists_the_api(client):
    paths = client.get("/schema/openapi.json").json()["paths"]
    for path in (
        "/api/profiles",
        "/api/profiles/{name}",
        "/api/profiles/{name}/children",
        "/api/profiles/{name}/retire",
        "/api/route/production",
        "/api/operators",
        "/api/operators/{name}/tokens",
        "/api/tokens/{token_id}",
        "/api/audit",
    ):
        assert path in paths
    assert not any(p.startswith("/profiles") for p in paths)  # pages are not API
