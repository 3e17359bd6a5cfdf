"""GPU readings through NVML, degrading per metric.

Under WSL2, NVML answers names, memory, temperature and power, but utilisation and per-process queries fail (with
NVMLError_Unknown, not NotSupported), and "used" memory includes what Windows applications hold. On a host without
an NVIDIA driver NVML is absent altogether. Every call is therefore guarded on its own: a metric NVML cannot give is
None, shown as "n/a", never 0.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import pynvml

GIB = 1 << 30


@dataclass(frozen=True)
class GpuReading:
    index: int
    name: str
    total_bytes: int | None
    used_bytes: int | None
    free_bytes: int | None
    temperature_c: int | None
    power_w: float | None
    utilization_pct: int | None


@dataclass(frozen=True)
class GpuSnapshot:
    # NVML answered; when it did not, `reason` says why (a CPU host, a missing driver).
    available: bool
    reason: str | None
    wsl: bool
    driver_version: str | None = None
    gpus: list[GpuReading] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


class Gpus(Protocol):
    def read(self) -> GpuSnapshot: ...


def host_is_wsl(proc_version: Path = Path("/proc/version")) -> bool:
    try:
        return "microsoft" in proc_version.read_text().lower()
    except OSError:
        return False


@dataclass(frozen=True)
class RankMemory:
    """One GPU of a running engine: its rank, and what the engine reported holding there (/server_info's
    gpu_memory_per_rank); None where it did not say (still starting, or a build that reports rank 0 only)."""

    rank: int
    weights_bytes: int | None = None
    kv_bytes: int | None = None
    graph_bytes: int | None = None


def engine_ranks(indices: list[int], server_info: dict[str, Any] | None) -> dict[int, RankMemory]:
    """The engine's GPUs by NVML index (`indices` in rank order), each with its rank and the engine's own memory
    figures for it: gpu_memory_per_rank, or gpu_memory for rank 0 where the engine gives only that."""
    info = server_info or {}
    per_rank = info.get("gpu_memory_per_rank")
    if not isinstance(per_rank, list):
        per_rank = [info["gpu_memory"]] if isinstance(info.get("gpu_memory"), dict) else []
    ranks = {}
    for rank, index in enumerate(indices):
        memory = per_rank[rank] if rank < len(per_rank) and isinstance(per_rank[rank], dict) else {}
        ranks[index] = RankMemory(rank, memory.get("weights_bytes"), memory.get("kv_bytes"), memory.get("graph_bytes"))
    return ranks


def listed_indices(value: str | None) -> list[int] | None:
    """A CUDA_VISIBLE_DEVICES value as indices; None when unset or not all indices (UUIDs, MIG names)."""
    parts = [part.strip() for part in (value or "").strip().split(",")] if (value or "").strip() else []
    if not parts or not all(part.isdigit() for part in parts):
        return None
    return [int(part) for part in parts]


def engine_gpu_indices(count: int, tensor_parallel_size: int, gpus: list[int] | None = None) -> list[int]:
    """The NVML indices of the GPUs an engine with this tensor parallelism uses, in rank order: the profile's `gpus`
    when it names them (they become the engine's CUDA_VISIBLE_DEVICES, whatever the console's own is; one this host
    lacks is listed still, for the preflight to refuse by name), else the first of the console's
    CUDA_VISIBLE_DEVICES when it lists indices, else the first of all."""
    if gpus is not None:
        return list(gpus)
    indices = list(range(count))
    if (visible := listed_indices(os.environ.get("CUDA_VISIBLE_DEVICES"))) is not None:
        indices = [i for i in visible if i < count]
    return indices[:tensor_parallel_size]


class NvmlGpus:
    """The real NVML (pynvml from nvidia-ml-py). `nvml` is the module; tests hand in a fake with the same calls."""

    def __init__(self, nvml: Any = pynvml, wsl: bool | None = None) -> None:
        self.nvml = nvml
        self.wsl = host_is_wsl() if wsl is None else wsl
        self._lock = threading.Lock()
        self._initialised = False
        self._unavailable: str | None = None

    def _init(self) -> str | None:
        """Initialise once; NVML that is absent at start stays absent (no driver appears at run time)."""
        with self._lock:
            if not self._initialised and self._unavailable is None:
                try:
                    self.nvml.nvmlInit()
                    self._initialised = True
                except self.nvml.NVMLError as exc:
                    self._unavailable = f"no NVIDIA GPU (NVML unavailable: {exc})"
            return self._unavailable

    def _get(self, call: str, *args: Any) -> Any:
        try:
            return getattr(self.nvml, call)(*args)
        except self.nvml.NVMLError:
            return None

    def read(self) -> GpuSnapshot:
        if (reason := self._init()) is not None:
            return GpuSnapshot(available=False, reason=reason, wsl=self.wsl)
        count = self._get("nvmlDeviceGetCount")
        if count is None:
            return GpuSnapshot(available=False, reason="NVML could not count the GPUs", wsl=self.wsl)
        gpus = []
        for index in range(count):
            handle = self._get("nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                continue
            name = self._get("nvmlDeviceGetName", handle)
            memory = self._get("nvmlDeviceGetMemoryInfo", handle)
            power_mw = self._get("nvmlDeviceGetPowerUsage", handle)
            utilization = self._get("nvmlDeviceGetUtilizationRates", handle)
            gpus.append(
                GpuReading(
                    index=index,
                    name=(name.decode() if isinstance(name, bytes) else name) or f"GPU {index}",
                    total_bytes=memory.total if memory else None,
                    used_bytes=memory.used if memory else None,
                    free_bytes=memory.free if memory else None,
                    temperature_c=self._get("nvmlDeviceGetTemperature", handle, self.nvml.NVML_TEMPERATURE_GPU),
                    power_w=power_mw / 1000 if power_mw is not None else None,
                    utilization_pct=utilization.gpu if utilization else None,
                )
            )
        driver = self._get("nvmlSystemGetDriverVersion")
        notes = []
        if self.wsl:
            notes.append(
                "WSL2: utilisation and per-process memory are not available from NVML, and 'used' includes what "
                "Windows applications hold (see Task Manager → GPU)"
            )
        return GpuSnapshot(
            available=True,
            reason=None,
            wsl=self.wsl,
            driver_version=driver.decode() if isinstance(driver, bytes) else driver,
            gpus=gpus,
            notes=notes,
        )
