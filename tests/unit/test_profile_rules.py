"""The profile rules as pure functions: each broken rule names its field and its limit."""

from __future__ import annotations

import msgspec
import pytest

from app.errors import name_errors
from app.profiles.schemas import (
    DEFAULT_MODEL_MAX_CONTEXT,
    ProfileSettings,
    content_hash,
    diff_warnings,
    host_errors,
    settings_diff,
    settings_errors,
)

BASE = ProfileSettings(
    model="tiny",
    dtype="float32",
    context_length=4096,
    max_num_batched_tokens=512,
    max_num_seqs=4,
    gpu_memory_utilization=0.5,
    kv_cache_dtype="auto",
    cuda_graph_max_bs=1,
    tensor_parallel_size=1,
    max_output_tokens=256,
)


def with_(**changes) -> ProfileSettings:
    return msgspec.structs.replace(BASE, **changes)


def test_a_valid_profile_has_no_errors():
    assert settings_errors(BASE) == []
    assert host_errors(BASE, DEFAULT_MODEL_MAX_CONTEXT) == []


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"context_length": 0}, "context_length", ["positive integer", "at least 1", "got 0"]),
        ({"max_num_seqs": -1}, "max_num_seqs", ["positive integer", "at least 1"]),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens", ["positive integer"]),
        ({"cuda_graph_max_bs": 0}, "cuda_graph_max_bs", ["positive integer"]),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size", ["positive integer"]),
        ({"max_output_tokens": 0}, "max_output_tokens", ["positive integer"]),
        ({"max_num_batched_tokens": 3}, "max_num_batched_tokens", ["at least max_num_seqs (4)", "got 3"]),
        ({"cuda_graph_max_bs": 5}, "cuda_graph_max_bs", ["at most max_num_seqs (4)", "got 5"]),
        ({"max_output_tokens": 5000}, "max_output_tokens", ["at most context_length (4096)"]),
        ({"gpu_memory_utilization": 0.0}, "gpu_memory_utilization", ["greater than 0 and less than 1", "got 0.0"]),
        ({"gpu_memory_utilization": 1.0}, "gpu_memory_utilization", ["greater than 0 and less than 1", "got 1.0"]),
        ({"dtype": "fp64"}, "dtype", ["one of auto, float32, bfloat16, float16", "'fp64'"]),
        ({"kv_cache_dtype": "int4"}, "kv_cache_dtype", ["one of auto, bfloat16, fp8_e4m3"]),
        ({"model": "/models/tiny"}, "model", ["relative path under FLASHGATE_MODELS_DIR", "not absolute"]),
        ({"model": "../elsewhere"}, "model", ["no '..'"]),
        ({"model": ""}, "model", ["not empty"]),
    ],
)
def test_each_rule_names_its_field_and_limit(changes, field, words):
    errors = settings_errors(with_(**changes))
    assert [e.field for e in errors] == [field]
    for word in words:
        assert word in errors[0].message
    assert errors[0].message.startswith(field)


def test_host_rules_name_the_model_maximum_and_tensor_parallelism():
    errors = host_errors(with_(context_length=8192, max_output_tokens=256), model_max_context=4096)
    assert [(e.field, "at most 4096" in e.message) for e in errors] == [("context_length", True)]
    errors = host_errors(with_(tensor_parallel_size=2), DEFAULT_MODEL_MAX_CONTEXT)
    assert errors[0].field == "tensor_parallel_size"
    assert "must be 1" in errors[0].message and "not available" in errors[0].message
    assert host_errors(with_(context_length=DEFAULT_MODEL_MAX_CONTEXT), DEFAULT_MODEL_MAX_CONTEXT) == []


@pytest.mark.parametrize("name", ["cpu-demo", "maxseq16-650k", "a", "x" * 63])
def test_good_names(name):
    assert name_errors(name) == []


@pytest.mark.parametrize("name", ["", "CPU", "cpu_demo", "-cpu", "cpu-", "cpu--demo", "a b", "x" * 64, "ü"])
def test_bad_names_name_the_rule(name):
    (error,) = name_errors(name)
    assert error.field == "name" and "lowercase slug of 1 to 63 characters" in error.message


def test_content_hash_covers_engine_settings_only():
    assert content_hash(BASE) == content_hash(with_())
    assert content_hash(BASE) != content_hash(with_(context_length=2048))
    assert content_hash(BASE) != content_hash(with_(engine_extras={"seed": 1}))
    assert content_hash(BASE) != content_hash(with_(revision="abc"))
    # The route's output clamp is not engine content: evidence about the engine still applies.
    assert content_hash(BASE) == content_hash(with_(max_output_tokens=128))


def test_diff_lists_each_changed_setting_and_extra():
    child = with_(context_length=2048, engine_extras={"seed": 7})
    diff = settings_diff(BASE, child)
    assert [(c.field, c.parent, c.value) for c in diff] == [
        ("context_length", 4096, 2048),
        ("engine_extras.seed", None, 7),
    ]
    (warning,) = diff_warnings(diff)
    assert "2 settings differ from the parent (context_length, engine_extras.seed)" in warning
    assert diff_warnings(diff[:1]) == []
    assert settings_diff(BASE, with_()) == []
