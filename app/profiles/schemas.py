"""Profile request and response shapes, and the rules a profile's settings must obey (pure, no database)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import PurePosixPath
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from app.errors import FieldError

# Mirrors engine/config.py; the planes share no code, and a profile is checked here before any engine starts.
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8_e4m3")
# How the engine spreads attention over tensor_parallel_size GPUs (engine/config.py ATTENTION_MODES); the routed
# experts are split over every GPU either way.
ATTENTION_MODES = ("data-parallel", "tensor-parallel")
# What each mode trades, in the words the profile page and docs/deploy.md use.
ATTENTION_TRADES = {
    "data-parallel": (
        "each GPU holds a replica of the dense attention weights and serves its own requests with its own KV pool, "
        "so KV capacity is the sum over the GPUs (V4 attention has one shared KV head: splitting heads would copy "
        "the whole KV cache to every GPU); best capacity and throughput at many concurrent requests, but at one or "
        "two concurrent requests the other GPUs idle"
    ),
    "tensor-parallel": (
        "the attention heads are split over the GPUs and every GPU runs every request, with one copy of the KV "
        "cache per GPU, so KV capacity is one GPU's pool; best single-stream latency"
    ),
}
# The limit when the model directory has no config.json to read max_position_embeddings from (DeepSeek-V4's own).
DEFAULT_MODEL_MAX_CONTEXT = 1_048_576
POSITIVE_INTS = (
    "context_length",
    "max_num_batched_tokens",
    "max_num_seqs",
    "cuda_graph_max_bs",
    "tensor_parallel_size",
    "max_output_tokens",
)


class ProfileSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything a profile sets. All but `max_output_tokens` (the route's clamp) reach the engine."""

    model: str
    revision: str | None = None
    dtype: str = "auto"
    context_length: int
    max_num_batched_tokens: int
    max_num_seqs: int
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    cuda_graph_max_bs: int
    tensor_parallel_size: int = 1
    # With tensor_parallel_size > 1: how attention is spread (ATTENTION_MODES).
    attention: str = "data-parallel"
    # The host's GPUs by index (as nvidia-smi and the dashboard number them), one per tensor_parallel_size: the
    # engine's CUDA_VISIBLE_DEVICES. None: the first tensor_parallel_size GPUs the console itself sees.
    gpus: list[int] | None = None
    max_output_tokens: int
    engine_extras: dict[str, Any] = msgspec.field(default_factory=dict)


SETTINGS: tuple[str, ...] = ProfileSettings.__struct_fields__
ENGINE_SETTINGS: tuple[str, ...] = tuple(f for f in SETTINGS if f != "max_output_tokens")
# Settings added after profiles had evidence, with the value every profile had before: a profile that keeps it hashes
# as it did then, so no evidence turns stale (content_hash leaves them out while they hold it).
HASHED_UNLESS_DEFAULT: dict[str, Any] = {"attention": "data-parallel", "gpus": None}


class ProfileCreate(ProfileSettings, kw_only=True, forbid_unknown_fields=True):
    """A new root profile (no parent)."""

    name: str
    rationale: str = ""


class ProfileChanges(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Settings to change; any left out keep their current (or the parent's) value."""

    model: str | UnsetType = UNSET
    revision: str | None | UnsetType = UNSET
    dtype: str | UnsetType = UNSET
    context_length: int | UnsetType = UNSET
    max_num_batched_tokens: int | UnsetType = UNSET
    max_num_seqs: int | UnsetType = UNSET
    gpu_memory_utilization: float | UnsetType = UNSET
    kv_cache_dtype: str | UnsetType = UNSET
    cuda_graph_max_bs: int | UnsetType = UNSET
    tensor_parallel_size: int | UnsetType = UNSET
    attention: str | UnsetType = UNSET
    gpus: list[int] | None | UnsetType = UNSET
    max_output_tokens: int | UnsetType = UNSET
    engine_extras: dict[str, Any] | UnsetType = UNSET

    def as_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in SETTINGS if getattr(self, f) is not UNSET}


class ProfileChildCreate(ProfileChanges, kw_only=True, forbid_unknown_fields=True):
    """A child: a copy of the parent with the given changes, and the reason for them."""

    name: str
    rationale: str


class ProfileUpdate(ProfileChanges, kw_only=True, forbid_unknown_fields=True):
    """An in-place change, allowed only while the profile has no evidence."""

    rationale: str | UnsetType = UNSET


class SettingChange(msgspec.Struct):
    field: str
    parent: Any
    value: Any


@dataclass(frozen=True)
class HostGpus:
    """The GPUs this host shows (NVML's indices), or why it shows none: what a profile's GPU rules are checked
    against."""

    indices: tuple[int, ...] = ()
    # Why there are none (a CPU host, no NVIDIA driver); None when NVML answered.
    reason: str | None = None

    def words(self) -> str:
        if not self.indices:
            return f"this host shows no GPU: {self.reason or 'NVML found none'}"
        count = len(self.indices)
        return f"this host shows {count} GPU{'s' if count > 1 else ''} ({_indices(self.indices)})"


def _indices(indices: tuple[int, ...] | list[int]) -> str:
    return ", ".join(str(i) for i in indices)


class ProfileState(msgspec.Struct):
    weights_present: bool
    model_max_context: int
    # This host shows the GPUs the profile needs (tensor_parallel_size of them, and the ones `gpus` names).
    tensor_parallel_available: bool
    evidence_count: int
    immutable: bool
    retired: bool
    # What stands between this profile and a running engine, in the operator's words ("weights missing", ...).
    blockers: list[str]


class ProfileRead(ProfileSettings, kw_only=True):
    name: str
    parent: str | None
    children: list[str]
    rationale: str
    content_hash: str
    created_at: datetime
    created_by: str
    retired_at: datetime | None
    retired_by: str | None
    state: ProfileState
    diff: list[SettingChange]
    warnings: list[str]
    # production, rollback, challenger, rejected (any that apply; none for a profile never qualified).
    roles: list[str]


def settings_errors(s: ProfileSettings) -> list[FieldError]:
    """The rules a profile obeys on any host: each message names the field and the limit it broke."""
    errors = [
        FieldError(f, f"{f} must be a positive integer (at least 1), got {getattr(s, f)}")
        for f in POSITIVE_INTS
        if getattr(s, f) < 1
    ]
    if 1 <= s.max_num_batched_tokens < s.max_num_seqs:
        errors.append(
            FieldError(
                "max_num_batched_tokens",
                f"max_num_batched_tokens must be at least max_num_seqs ({s.max_num_seqs}), "
                f"got {s.max_num_batched_tokens}",
            )
        )
    if s.cuda_graph_max_bs > s.max_num_seqs >= 1:
        errors.append(
            FieldError(
                "cuda_graph_max_bs",
                f"cuda_graph_max_bs must be at most max_num_seqs ({s.max_num_seqs}), got {s.cuda_graph_max_bs}",
            )
        )
    if s.max_output_tokens > s.context_length >= 1:
        errors.append(
            FieldError(
                "max_output_tokens",
                f"max_output_tokens must be at most context_length ({s.context_length}), got {s.max_output_tokens}",
            )
        )
    if not 0.0 < s.gpu_memory_utilization < 1.0:
        errors.append(
            FieldError(
                "gpu_memory_utilization",
                f"gpu_memory_utilization must be greater than 0 and less than 1, got {s.gpu_memory_utilization}",
            )
        )
    if s.dtype not in DTYPES:
        errors.append(FieldError("dtype", f"dtype must be one of {', '.join(DTYPES)}; got {s.dtype!r}"))
    if s.kv_cache_dtype not in KV_CACHE_DTYPES:
        errors.append(
            FieldError(
                "kv_cache_dtype",
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {s.kv_cache_dtype!r}",
            )
        )
    if s.attention not in ATTENTION_MODES:
        errors.append(
            FieldError("attention", f"attention must be one of {', '.join(ATTENTION_MODES)}; got {s.attention!r}")
        )
    errors += gpus_errors(s)
    path = PurePosixPath(s.model)
    if not s.model.strip() or path.is_absolute() or ".." in path.parts or "\\" in s.model:
        errors.append(
            FieldError(
                "model",
                f"model must be a relative path under FLASHGATE_MODELS_DIR (not empty, not absolute, no '..'), "
                f"got {s.model!r}",
            )
        )
    return errors


def gpus_errors(s: ProfileSettings) -> list[FieldError]:
    """`gpus`, on any host: distinct GPU indices, one for each of tensor_parallel_size."""
    if s.gpus is None:
        return []
    errors = []
    if any(i < 0 for i in s.gpus):
        errors.append(FieldError("gpus", f"gpus must be GPU indices (whole numbers, 0 or more), got {s.gpus}"))
    if len(set(s.gpus)) != len(s.gpus):
        errors.append(FieldError("gpus", f"gpus must name each GPU once, got {s.gpus}"))
    if len(s.gpus) != s.tensor_parallel_size >= 1:
        errors.append(
            FieldError(
                "gpus",
                f"gpus must list tensor_parallel_size ({s.tensor_parallel_size}) GPU"
                f"{'s' if s.tensor_parallel_size > 1 else ''}, one per engine process, got {len(s.gpus)}: {s.gpus}",
            )
        )
    return errors


def host_errors(s: ProfileSettings, model_max_context: int, gpus: HostGpus) -> list[FieldError]:
    """The rules that depend on this host and its model files: refused for an operator's write, shown as a state
    (a blocker) on a seeded profile, since the field's profiles are a record worth keeping even where they cannot
    run yet. `gpus`: what this host shows."""
    errors = []
    if s.context_length > model_max_context:
        errors.append(
            FieldError(
                "context_length",
                f"context_length must be at most {model_max_context} (the model's maximum context), "
                f"got {s.context_length}",
            )
        )
    if s.tensor_parallel_size > max(1, len(gpus.indices)):
        most = len(gpus.indices) if gpus.indices else 1
        errors.append(
            FieldError(
                "tensor_parallel_size",
                f"tensor_parallel_size must be at most {most} (one engine process per GPU; {gpus.words()}), "
                f"got {s.tensor_parallel_size}",
            )
        )
    # Which listed GPU is missing, once the list itself is right (gpus_errors says what is wrong with it otherwise).
    if s.gpus is not None and not gpus_errors(s) and (missing := [i for i in s.gpus if i not in gpus.indices]):
        errors.append(
            FieldError(
                "gpus",
                f"gpus must name GPUs this host shows ({gpus.words()}), got {s.gpus}: "
                f"GPU {_indices(missing)} {'is' if len(missing) == 1 else 'are'} not there",
            )
        )
    return errors


def content_hash(s: ProfileSettings) -> str:
    """sha256 over what the engine is started with: evidence is about exactly this content. A setting of
    HASHED_UNLESS_DEFAULT counts only once it differs from its default, so a profile that keeps it hashes as before
    the setting existed."""
    payload = {
        f: getattr(s, f)
        for f in ENGINE_SETTINGS
        if f not in HASHED_UNLESS_DEFAULT or getattr(s, f) != HASHED_UNLESS_DEFAULT[f]
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def settings_diff(parent: ProfileSettings, child: ProfileSettings) -> list[SettingChange]:
    """What differs, one entry per setting; each engine extra counts as a setting of its own."""
    changes = [
        SettingChange(f, getattr(parent, f), getattr(child, f))
        for f in SETTINGS
        if f != "engine_extras" and getattr(parent, f) != getattr(child, f)
    ]
    for key in sorted(set(parent.engine_extras) | set(child.engine_extras)):
        before, after = parent.engine_extras.get(key), child.engine_extras.get(key)
        if before != after:
            changes.append(SettingChange(f"engine_extras.{key}", before, after))
    return changes


def diff_warnings(diff: list[SettingChange]) -> list[str]:
    if len(diff) <= 1:
        return []
    return [
        f"{len(diff)} settings differ from the parent ({', '.join(c.field for c in diff)}): change one at a time, "
        f"so the evidence says which change did what"
    ]
