"""A stand-in for the pynvml module (there is no GPU here), handed to the real `NvmlGpus` in place of pynvml: the same
calls and pynvml's own error classes, with GPUs described by the test. `wsl=True` fails what NVML fails under WSL2
(utilisation, with NVMLError_Unknown rather than NotSupported); `absent=True` is a host without the driver."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pynvml

GIB = 1 << 30


@dataclass
class FakeGpu:
    name: str = "NVIDIA H200"
    total: int = 141 * GIB
    used: int = 1 * GIB
    temperature_c: int = 34
    power_mw: int = 74_000


class FakeNvml:
    NVMLError = pynvml.NVMLError
    NVML_TEMPERATURE_GPU = pynvml.NVML_TEMPERATURE_GPU

    def __init__(self, gpus: list[FakeGpu] | None = None, wsl: bool = False, absent: bool = False) -> None:
        self.gpus = gpus if gpus is not None else [FakeGpu()]
        self.wsl = wsl
        self.absent = absent
        self.reads = 0

    def nvmlInit(self) -> None:
        if self.absent:
            raise pynvml.NVMLError_LibraryNotFound()

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        return gpu.name

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        self.reads += 1
        return SimpleNamespace(total=gpu.total, used=gpu.used, free=gpu.total - gpu.used)

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        return gpu.power_mw

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> SimpleNamespace:
        if self.wsl:
            raise pynvml.NVMLError_Unknown()
        return SimpleNamespace(gpu=37, memory=12)

    def nvmlSystemGetDriverVersion(self) -> str:
        return "570.124.06"
