"""The one interface the supervisor drives an engine through, whichever driver runs it, and the engine's command
line built from a profile (a flag per EngineConfig field, dashes for underscores)."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from app.engine_control.preflight import Check
from app.profiles.models import Profile


class DriverError(RuntimeError):
    """The driver could not do what was asked (no process started, the container or its proxy unreachable)."""


@dataclass(frozen=True)
class EngineCommand:
    run_id: int
    profile: str
    content_hash: str
    # The arguments after `python -m engine serve`.
    args: list[str]
    # Set in the engine's environment on top of what it inherits (engine_env: the profile's GPUs).
    env: dict[str, str] = field(default_factory=dict)


class EngineHandle(Protocol):
    """One started engine."""

    pid: int | None
    container: str | None

    def lines(self) -> Iterator[str]:
        """The engine's output (stdout and stderr) line by line, once it is in the run's log file, until it ends."""
        ...

    def exit_code(self) -> int | None:
        """None while the engine runs."""
        ...

    def terminate(self, grace_s: float) -> int | None:
        """SIGTERM, up to `grace_s` to exit, then SIGKILL; returns the exit code. `grace_s=0` kills at once."""
        ...


class EngineDriver(Protocol):
    name: str
    # Where the engine answers HTTP, as the console reaches it.
    base_url: str
    # The address the engine binds (loopback for a child process, all interfaces inside a container).
    bind_host: str

    def preflight(self) -> list[Check]:
        """The driver's own checks before a start (the port is free, the container exists)."""
        ...

    def launch(self, command: EngineCommand, log_path: Path) -> EngineHandle:
        """Start the engine with its output going to `log_path`."""
        ...

    def reclaim(self, pid: int | None, container: str | None, grace_s: float) -> str:
        """Stop an engine a previous console process left behind; says what was done."""
        ...


def _flag(key: str, value: Any) -> list[str]:
    """One engine flag: booleans as `--x` / `--no-x`, None as the word the engine reads as unset."""
    flag = f"--{key.replace('_', '-')}"
    if isinstance(value, bool):
        return [flag] if value else [f"--no-{flag[2:]}"]
    return [flag, "none" if value is None else str(value)]


def engine_args(profile: Profile, models_dir: Path, host: str, port: int) -> list[str]:
    """`python -m engine serve` arguments for a profile. `revision` and `max_output_tokens` are the console's (the
    weights' provenance and the route's clamp), not engine settings; engine_extras pass through as flags."""
    settings = {
        "model": models_dir / profile.model,
        "served_model_name": profile.name,
        "dtype": profile.dtype,
        "context_length": profile.context_length,
        "max_num_batched_tokens": profile.max_num_batched_tokens,
        "max_num_seqs": profile.max_num_seqs,
        "gpu_memory_utilization": profile.gpu_memory_utilization,
        "kv_cache_dtype": profile.kv_cache_dtype,
        "cuda_graph_max_bs": profile.cuda_graph_max_bs,
        "tensor_parallel_size": profile.tensor_parallel_size,
        "attention": profile.attention,
        **dict(sorted(profile.engine_extras.items())),
        "host": host,
        "port": port,
    }
    return [arg for key, value in settings.items() for arg in _flag(key, value)]


def engine_env(profile: Profile) -> dict[str, str]:
    """What the engine's environment gets from a profile. `gpus` becomes CUDA_VISIBLE_DEVICES (the engine's ranks take
    CUDA devices 0..N-1 of those visible, in that order), numbered as NVML and nvidia-smi number the GPUs, which is
    PCI bus order: CUDA's own default order (fastest first) may differ on a host with mixed GPUs. Without `gpus`,
    nothing: the engine inherits the console's environment, as before."""
    if profile.gpus is None:
        return {}
    return {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in profile.gpus), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def describe_exit(code: int | None) -> str:
    """An exit code in words: a negative code (Popen) or 128+n (a container) names the signal."""
    if code is None:
        return "no exit code"
    number = -code if code < 0 else code - 128 if code > 128 else None
    try:
        return f"exit code {code} ({signal.Signals(number).name})" if number else f"exit code {code}"
    except ValueError:
        return f"exit code {code}"
