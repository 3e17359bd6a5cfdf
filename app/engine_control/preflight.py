"""Checks before a start, and the weights fingerprint a run records.

A check fails only on a fact that makes the start pointless (no weights, a host rule broken, less free VRAM than the
profile claims); what merely looks risky is a warning. Estimates that refuse loads which would succeed are a known
pain of other products, so nothing here guesses the engine's memory beyond what the profile itself claims.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path

from app.profiles.models import Profile
from app.profiles.schemas import HostGpus, host_errors
from app.profiles.service import inspect_model, settings_of
from app.telemetry.gpus import GpuSnapshot, engine_gpu_indices
from app.units import byte_size

# A safetensors file starts with the header's length (8 bytes, little endian) and the JSON header itself; a length
# beyond this is not a safetensors file (real headers are a few MB at most).
SAFETENSORS_HEADER_MAX = 100 * 1024 * 1024


class CheckStatus(StrEnum):
    ok = "ok"
    warn = "warn"
    fail = "fail"
    na = "n/a"


@dataclass(frozen=True)
class Check:
    name: str
    status: CheckStatus
    detail: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


@dataclass(frozen=True)
class Fingerprint:
    sha256: str
    files: int
    total_bytes: int
    safetensors_bytes: int


class FingerprintError(ValueError):
    pass


def _safetensors_header(path: Path, size: int) -> bytes:
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if length > SAFETENSORS_HEADER_MAX or 8 + length > size:
            raise FingerprintError(f"{path} is not a safetensors file (header length {length}, file size {size})")
        return f.read(length)


def weights_fingerprint(directory: Path) -> Fingerprint:
    """sha256 over each file's relative name and size, plus the sha256 of every safetensors header (which names
    every tensor with its dtype, shape and offsets): cheap on a 150 GB checkpoint, and it changes when the weights
    do. Hidden files (download caches) are left out."""
    digest = hashlib.sha256()
    files = total = tensors = 0
    for path in sorted(directory.rglob("*")):
        relative = path.relative_to(directory)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        size = path.stat().st_size
        digest.update(f"{relative.as_posix()}\0{size}\0".encode())
        if path.suffix == ".safetensors":
            digest.update(hashlib.sha256(_safetensors_header(path, size)).digest())
            tensors += size
        files += 1
        total += size
    return Fingerprint(sha256=digest.hexdigest(), files=files, total_bytes=total, safetensors_bytes=tensors)


def meminfo_bytes(key: str, meminfo: Path = Path("/proc/meminfo")) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            name, _, rest = line.partition(":")
            if name == key:
                return int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def host_gpus(gpus: GpuSnapshot) -> HostGpus:
    """What a profile's GPU rules check against: the GPUs NVML shows, or why there are none."""
    if not gpus.available:
        return HostGpus((), gpus.reason)
    return HostGpus(tuple(g.index for g in gpus.gpus), None if gpus.gpus else "NVML counted no GPU")


def vram_checks(profile: Profile, gpus: GpuSnapshot, weights_bytes: int) -> list[Check]:
    """Free VRAM on each of the engine's GPUs against what the profile claims (gpu_memory_utilization × total), and
    each GPU's share of the weights against that claim. Free memory and the claim are facts the engine itself would
    trip over; the share is the checkpoint split evenly over the GPUs (the routed experts are, in both attention
    modes; data-parallel attention also keeps a replica of the dense attention weights on each GPU), so it can
    only understate what a GPU holds and never refuses a load that fits."""
    if not gpus.available:
        return [Check("vram", CheckStatus.na, f"{gpus.reason}: the engine runs on the CPU")]
    tp = profile.tensor_parallel_size
    indices = engine_gpu_indices(len(gpus.gpus), tp, profile.gpus)
    if len(indices) < tp:
        detail = f"tensor_parallel_size {tp} needs as many GPUs; {len(indices)} visible"
        return [Check("vram", CheckStatus.fail, detail)]
    by_index = {g.index: g for g in gpus.gpus}
    share = weights_bytes / tp
    split = f"the weights' {byte_size(weights_bytes)} split over {tp} GPUs, an estimate"
    checks = []
    for rank, index in enumerate(indices):
        gpu = by_index.get(index)
        where = f"GPU {index}" + (f" (rank {rank})" if tp > 1 else "")
        if gpu is None:
            detail = f"{where}: not on this host (NVML shows {_listed(by_index)})"
            checks.append(Check("vram", CheckStatus.fail, detail))
            continue
        where = f"GPU {index} ({gpu.name}" + (f", rank {rank})" if tp > 1 else ")")
        if gpu.total_bytes is None or gpu.free_bytes is None:
            checks.append(Check("vram", CheckStatus.warn, f"{where}: NVML gave no memory info"))
            continue
        claim = profile.gpu_memory_utilization * gpu.total_bytes
        if gpu.free_bytes < claim:
            hint = "; on WSL2 Windows applications hold VRAM too: check Task Manager → GPU" if gpus.wsl else ""
            checks.append(
                Check(
                    "vram",
                    CheckStatus.fail,
                    f"{where}: {byte_size(gpu.free_bytes)} free, but the profile claims gpu_memory_utilization "
                    f"{profile.gpu_memory_utilization} × {byte_size(gpu.total_bytes)} = {byte_size(claim)}: "
                    f"free the GPU or lower gpu_memory_utilization{hint}",
                )
            )
        elif share >= claim:
            checks.append(
                Check(
                    "vram",
                    CheckStatus.fail,
                    f"{where}: the weights ({byte_size(share)}"
                    + (f" per GPU: {split}" if tp > 1 else "")
                    + f") do not fit in what the profile claims ({byte_size(claim)}), leaving nothing for the KV cache",
                )
            )
        else:
            checks.append(
                Check(
                    "vram",
                    CheckStatus.ok,
                    f"{where}: {byte_size(gpu.free_bytes)} free ≥ {byte_size(claim)} claimed; "
                    f"weights {byte_size(share)}" + (f" per GPU ({split})" if tp > 1 else ""),
                )
            )
    return checks


def _listed(by_index: dict[int, object]) -> str:
    return "GPU " + ", ".join(str(i) for i in sorted(by_index)) if by_index else "none"


def wsl_memory_check(weights_bytes: int, meminfo: Path = Path("/proc/meminfo")) -> Check:
    """WSL2 caps the Linux VM's memory (half the host's by default, `memory=` in .wslconfig); loading weights larger
    than the cap pages heavily or fails. A warning: the engine may still load them piecewise."""
    limit = meminfo_bytes("MemTotal", meminfo)
    if limit is None:
        return Check("wsl_memory", CheckStatus.warn, "WSL2: could not read MemTotal from /proc/meminfo")
    if weights_bytes > limit:
        return Check(
            "wsl_memory",
            CheckStatus.warn,
            f"WSL2 memory limit {byte_size(limit)} is below the weights' {byte_size(weights_bytes)}: raise memory= in "
            f".wslconfig, then run `wsl --shutdown`",
        )
    return Check(
        "wsl_memory", CheckStatus.ok, f"WSL2 memory limit {byte_size(limit)} ≥ weights {byte_size(weights_bytes)}"
    )


def profile_checks(profile: Profile, models_dir: Path, gpus: GpuSnapshot) -> tuple[list[Check], Fingerprint | None]:
    """What the profile and its weights allow on this host (its GPUs: `gpus`), whatever runs on them now; the
    weights' fingerprint when they are present and readable."""
    checks = []
    if profile.retired:
        checks.append(Check("profile", CheckStatus.fail, f"profile {profile.name!r} is retired"))
    directory = models_dir / profile.model
    files = inspect_model(models_dir, profile.model)
    checks += [
        Check(e.field, CheckStatus.fail, e.message)
        for e in host_errors(settings_of(profile), files.max_context, host_gpus(gpus))
    ]
    if not files.weights_present:
        found = "needs config.json and *.safetensors" if directory.is_dir() else "does not exist"
        checks.append(Check("weights", CheckStatus.fail, f"weights missing: {directory} {found}"))
        return checks, None
    try:
        fingerprint = weights_fingerprint(directory)
    except (OSError, FingerprintError) as exc:
        checks.append(Check("weights", CheckStatus.fail, f"weights unreadable: {exc}"))
        return checks, None
    checks.append(
        Check(
            "weights",
            CheckStatus.ok,
            f"{directory}: {fingerprint.files} files, {byte_size(fingerprint.total_bytes)}, "
            f"fingerprint {fingerprint.sha256[:16]}…",
        )
    )
    return checks, fingerprint


def memory_checks(profile: Profile, gpus: GpuSnapshot, fingerprint: Fingerprint) -> list[Check]:
    """What the host has free for this profile right now."""
    checks = vram_checks(profile, gpus, fingerprint.safetensors_bytes)
    if gpus.wsl:
        checks.append(wsl_memory_check(fingerprint.safetensors_bytes))
    return checks


def failures(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.status is CheckStatus.fail]
