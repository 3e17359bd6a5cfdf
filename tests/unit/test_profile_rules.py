"""The profile rules as pure functions: each broken rule names its field and its limit; the content hash, which the
settings added for one engine over several GPUs leave as it was while they hold their defaults."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import yaml

from app.errors import name_errors
from app.profiles.schemas import (
    DEFAULT_MODEL_MAX_CONTEXT,
    SETTINGS,
    HostGpus,
    ProfileCreate,
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


CPU_HOST = HostGpus((), "no NVIDIA GPU (NVML unavailable: x)")
TWO_GPUS = HostGpus((0, 1))
SEEDS = Path(__file__).resolve().parents[2] / "profiles"


def with_(**changes) -> ProfileSettings:
    return msgspec.structs.replace(BASE, **changes)


def test_a_valid_profile_has_no_errors():
    assert settings_errors(BASE) == []
    assert host_errors(BASE, DEFAULT_MODEL_MAX_CONTEXT, CPU_HOST) == []
    assert host_errors(BASE, DEFAULT_MODEL_MAX_CONTEXT, TWO_GPUS) == []


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
        ({"attention": "pipeline"}, "attention", ["one of data-parallel, tensor-parallel", "'pipeline'"]),
        ({"gpus": [0, 1]}, "gpus", ["tensor_parallel_size (1) GPU,", "got 2: [0, 1]"]),
        ({"gpus": []}, "gpus", ["tensor_parallel_size (1)", "got 0: []"]),
        ({"tensor_parallel_size": 2, "gpus": [1]}, "gpus", ["tensor_parallel_size (2) GPUs", "got 1: [1]"]),
        ({"tensor_parallel_size": 2, "gpus": [1, 1]}, "gpus", ["each GPU once", "[1, 1]"]),
        ({"tensor_parallel_size": 2, "gpus": [-1, 0]}, "gpus", ["0 or more", "[-1, 0]"]),
    ],
)
def test_each_rule_names_its_field_and_limit(changes, field, words):
    errors = settings_errors(with_(**changes))
    assert [e.field for e in errors] == [field]
    for word in words:
        assert word in errors[0].message
    assert errors[0].message.startswith(field)


def test_host_rules_name_the_model_maximum_and_the_gpus_this_host_shows():
    errors = host_errors(with_(context_length=8192, max_output_tokens=256), 4096, CPU_HOST)
    assert [(e.field, "at most 4096" in e.message) for e in errors] == [("context_length", True)]
    assert host_errors(with_(context_length=DEFAULT_MODEL_MAX_CONTEXT), DEFAULT_MODEL_MAX_CONTEXT, CPU_HOST) == []
    # More engine processes than GPUs: on a CPU host, and on a host with two.
    (cpu,) = host_errors(with_(tensor_parallel_size=2), DEFAULT_MODEL_MAX_CONTEXT, CPU_HOST)
    assert cpu.field == "tensor_parallel_size" and cpu.message == (
        "tensor_parallel_size must be at most 1 (one engine process per GPU; this host shows no GPU: no NVIDIA GPU "
        "(NVML unavailable: x)), got 2"
    )
    (few,) = host_errors(with_(tensor_parallel_size=4), DEFAULT_MODEL_MAX_CONTEXT, TWO_GPUS)
    assert few.message == (
        "tensor_parallel_size must be at most 2 (one engine process per GPU; this host shows 2 GPUs (0, 1)), got 4"
    )
    assert host_errors(with_(tensor_parallel_size=2), DEFAULT_MODEL_MAX_CONTEXT, TWO_GPUS) == []
    # gpus names GPUs this host must show.
    assert host_errors(with_(tensor_parallel_size=2, gpus=[1, 0]), DEFAULT_MODEL_MAX_CONTEXT, TWO_GPUS) == []
    (absent,) = host_errors(with_(tensor_parallel_size=2, gpus=[1, 3]), DEFAULT_MODEL_MAX_CONTEXT, TWO_GPUS)
    assert absent.field == "gpus" and absent.message == (
        "gpus must name GPUs this host shows (this host shows 2 GPUs (0, 1)), got [1, 3]: GPU 3 is not there"
    )
    (none,) = host_errors(with_(gpus=[0]), DEFAULT_MODEL_MAX_CONTEXT, CPU_HOST)
    assert none.field == "gpus" and "this host shows no GPU" in none.message and "GPU 0 is not there" in none.message


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
    # The attention mode and the GPUs are, once they differ from their defaults.
    two = with_(tensor_parallel_size=2)
    assert content_hash(two) != content_hash(with_(tensor_parallel_size=2, attention="tensor-parallel"))
    assert content_hash(two) != content_hash(with_(tensor_parallel_size=2, gpus=[0, 1]))
    assert content_hash(with_(tensor_parallel_size=2, gpus=[0, 1])) != content_hash(
        with_(tensor_parallel_size=2, gpus=[1, 0])
    )
    assert content_hash(two) == content_hash(with_(tensor_parallel_size=2, attention="data-parallel", gpus=None))


def _seeded(name: str) -> ProfileSettings:
    data = msgspec.convert(yaml.safe_load((SEEDS / f"{name}.yaml").read_text()), ProfileCreate)
    return ProfileSettings(**{f: getattr(data, f) for f in SETTINGS})


# Each seeded profile's content hash as computed before profiles had `attention` and `gpus` (at 3a59676): evidence
# recorded against these hashes must stay current. The content each was hashed with is the seed's today, but for
# what changed since on purpose (and changes the hash, as changed weights must): cpu-demo served the random tiny
# checkpoint then, the shipped demo model now.
CHANGED_SINCE = {"cpu-demo": {"model": "tiny"}}
HASHES_BEFORE_ATTENTION_AND_GPUS = {
    "cpu-demo": "804f0c499750c240a5b461c300a47295a04763583b4f1f9bf7ada8f31bd958c2",
    "maxseq1-1m": "3ddb43b9ecbd1b7b8ef07eab7e332adac48f0d125723742314576c952f987342",
    "maxseq16-128k": "c02634ed8a90924b9564e0290ddcd8f6dfd9a624083aad855f5405a90a69659d",
    "maxseq16-1m": "2b8e71d0e41195e547b20acabea7b039a6c83bde45be99be1f20195cb107ebe6",
    "maxseq16-650k": "386ee05935b2ad552d008edca695359237081b14785f5194cd0ea9967eb062f7",
    "maxseq4-1m": "c31415e3cea1049da855664498d7edb1679d7d727dfc102ba5b24daab9f4592a",
}


@pytest.mark.parametrize("name", HASHES_BEFORE_ATTENTION_AND_GPUS)
def test_existing_profiles_keep_their_content_hash(name):
    settings = msgspec.structs.replace(_seeded(name), **CHANGED_SINCE.get(name, {}))
    assert (settings.attention, settings.gpus) == ("data-parallel", None)
    assert content_hash(settings) == HASHES_BEFORE_ATTENTION_AND_GPUS[name]


def test_cpu_demo_serves_the_shipped_demo_model_and_so_hashes_anew():
    seeded = _seeded("cpu-demo")
    assert seeded.model == "demo"
    assert content_hash(seeded) != HASHES_BEFORE_ATTENTION_AND_GPUS["cpu-demo"]


def test_an_operators_child_keeps_its_content_hash():
    # A child as an operator made it before (another context, a revision, an extra), hashed at 3a59676.
    child = msgspec.structs.replace(
        _seeded("cpu-demo"),
        **CHANGED_SINCE["cpu-demo"],
        context_length=2048,
        revision="abc123",
        engine_extras={"seed": 7},
    )
    assert content_hash(child) == "39bf10415f74eeb1f34c861d26b089cd1eb7b3fbd47e2eea66b8416f109b5190"
    assert content_hash(msgspec.structs.replace(child, attention="tensor-parallel")) != content_hash(child)


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
