"""Supervisor pieces without an engine: reading the engine's output, the command line built from a profile (checked
against the engine's own parser), exit codes in words, the weights fingerprint, the memory checks, whether the GPU
memory came back, log retention, and the settings."""

from __future__ import annotations

import json
import struct

import pytest

from app.engine_control.bootlog import BootStage, LoadProgress, ReadyLine, parse_line
from app.engine_control.driver import describe_exit, engine_args, engine_env
from app.engine_control.logfiles import prune, run_log_path, tail_lines
from app.engine_control.preflight import (
    CheckStatus,
    FingerprintError,
    host_gpus,
    vram_checks,
    weights_fingerprint,
    wsl_memory_check,
)
from app.engine_control.supervisor import gpu_release
from app.profiles.models import Profile
from app.profiles.schemas import HostGpus
from app.settings import load_settings
from app.telemetry.gpus import GpuReading, GpuSnapshot, NvmlGpus
from engine.server.cli import build_parser
from tests.console.fake_nvml import GIB, FakeGpu, FakeNvml


def profile(**changes) -> Profile:
    settings = {
        "name": "cpu-demo-1k",
        "rationale": "r",
        "model": "tiny",
        "dtype": "float32",
        "context_length": 1024,
        "max_num_batched_tokens": 512,
        "max_num_seqs": 4,
        "gpu_memory_utilization": 0.9,
        "kv_cache_dtype": "auto",
        "cuda_graph_max_bs": 1,
        "tensor_parallel_size": 1,
        "max_output_tokens": 256,
        "engine_extras": {},
        "content_hash": "h",
        "created_by": "test",
    }
    return Profile(**{**settings, **changes})


def test_boot_stages_ready_line_and_progress_are_read_from_the_output():
    stage = parse_line(
        '{"stage": "kv_alloc", "seconds": 0.5, "kv_pages": 16, "event": "boot_stage", "level": "info", '
        '"timestamp": "2026-11-30T07:15:59.868396Z"}'
    )
    assert stage == BootStage("kv_alloc", 0.5, {"kv_pages": 16})
    failed = parse_line('{"event": "boot_stage", "stage": "failed", "seconds": 2, "error": "CUDA out of memory"}')
    assert failed == BootStage("failed", 2.0, {"error": "CUDA out of memory"})
    ready = parse_line(
        "engine ready: context_len=1024 max_total_num_tokens=4096 max_num_seqs=4 max_num_batched_tokens=512 "
        "available_gpu_mem=71.25GiB"
    )
    assert ready == ReadyLine(
        {
            "context_len": 1024,
            "max_total_num_tokens": 4096,
            "max_num_seqs": 4,
            "max_num_batched_tokens": 512,
            "available_gpu_mem_gib": 71.25,
        }
    )
    progress = parse_line('{"tensors_loaded": 42, "tensors_total": 210, "event": "load_progress"}')
    assert progress == LoadProgress(42, 210)
    for noise in (
        "INFO:     Started server process",
        '{"event": "boot_stage", "stage": "warming_up"}',
        '{"event": "request_finished"}',
        "{not json",
        "[1, 2]",
    ):
        assert parse_line(noise) is None


def test_engine_args_are_a_flag_per_setting_and_the_engine_accepts_them(tmp_path):
    extras = {"num_kv_pages": 16, "quant_sim": False, "request_timeout_s": None}
    args = engine_args(profile(engine_extras=extras), tmp_path, "127.0.0.1", 31000)
    assert args[:4] == ["--model", str(tmp_path / "tiny"), "--served-model-name", "cpu-demo-1k"]
    assert args[-4:] == ["--host", "127.0.0.1", "--port", "31000"]
    assert "--no-quant-sim" in args and args[args.index("--request-timeout-s") + 1] == "none"
    assert "--max-output-tokens" not in args and "--revision" not in args  # the console's, not the engine's
    parsed = build_parser().parse_args(["serve", *args])
    assert (parsed.context_length, parsed.max_num_seqs, parsed.max_num_batched_tokens) == (1024, 4, 512)
    assert (parsed.num_kv_pages, parsed.quant_sim, parsed.request_timeout_s, parsed.port) == (16, False, None, 31000)
    assert parsed.gpu_memory_utilization == 0.9 and parsed.cuda_graph_max_bs == 1 and parsed.dtype == "float32"
    assert (parsed.tensor_parallel_size, parsed.attention) == (1, "data-parallel")


def test_the_attention_mode_and_the_gpus_reach_the_engine(tmp_path):
    chosen = profile(tensor_parallel_size=2, attention="tensor-parallel", gpus=[2, 0])
    args = engine_args(chosen, tmp_path, "127.0.0.1", 31000)
    assert args[args.index("--attention") + 1] == "tensor-parallel"
    parsed = build_parser().parse_args(["serve", *args])
    assert (parsed.tensor_parallel_size, parsed.attention) == (2, "tensor-parallel")
    # The GPUs are the engine's environment, not a flag; numbered as NVML (PCI bus order) numbers them.
    assert "--gpus" not in args
    assert engine_env(chosen) == {"CUDA_VISIBLE_DEVICES": "2,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert engine_env(profile(tensor_parallel_size=2)) == {}  # none named: the console's environment, as before


def test_exit_codes_in_words():
    assert describe_exit(-9) == "exit code -9 (SIGKILL)"
    assert describe_exit(137) == "exit code 137 (SIGKILL)"
    assert describe_exit(143) == "exit code 143 (SIGTERM)"
    assert describe_exit(0) == "exit code 0" and describe_exit(1) == "exit code 1"
    assert describe_exit(200) == "exit code 200" and describe_exit(None) == "no exit code"


def safetensors(path, header: dict, payload: bytes = b"\0" * 16) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + payload)


def test_weights_fingerprint_follows_names_sizes_and_headers(tmp_path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    header = {"w": {"dtype": "BF16", "shape": [2, 4], "data_offsets": [0, 16]}}
    safetensors(model / "model-00001.safetensors", header)
    first = weights_fingerprint(model)
    assert (first.files, first.safetensors_bytes) == (2, (model / "model-00001.safetensors").stat().st_size)
    (model / ".cache").mkdir()
    (model / ".cache" / "download.lock").write_text("x")
    assert weights_fingerprint(model) == first  # hidden download caches are not weights
    # The same size, another tensor dtype: the header says so.
    safetensors(model / "model-00001.safetensors", {"w": {"dtype": "F16", "shape": [2, 4], "data_offsets": [0, 16]}})
    assert weights_fingerprint(model).sha256 != first.sha256
    safetensors(model / "model-00001.safetensors", header)
    assert weights_fingerprint(model) == first
    (model / "model-00001.safetensors").rename(model / "model-00002.safetensors")
    assert weights_fingerprint(model).sha256 != first.sha256
    (model / "broken.safetensors").write_bytes(struct.pack("<Q", 1 << 40))
    with pytest.raises(FingerprintError, match="broken.safetensors is not a safetensors file"):
        weights_fingerprint(model)


def gpus(*free_total: tuple[int, int], wsl: bool = False) -> GpuSnapshot:
    readings = [
        GpuReading(i, "NVIDIA H200", total, total - free, free, 30, 80.0, None)
        for i, (free, total) in enumerate(free_total)
    ]
    return GpuSnapshot(available=True, reason=None, wsl=wsl, gpus=readings)


def test_vram_checks_compare_free_memory_with_what_the_profile_claims():
    (ok,) = vram_checks(profile(), gpus((130 * GIB, 140 * GIB)), 20 * GIB)
    assert (
        ok.status is CheckStatus.ok
        and ok.detail == "GPU 0 (NVIDIA H200): 130.0 GiB free ≥ 126.0 GiB claimed; weights 20.0 GiB"
    )
    (busy,) = vram_checks(profile(), gpus((60 * GIB, 140 * GIB), wsl=True), 20 * GIB)
    assert busy.status is CheckStatus.fail and "60.0 GiB free, but the profile claims" in busy.detail
    assert "Task Manager" in busy.detail
    (heavy,) = vram_checks(profile(gpu_memory_utilization=0.5), gpus((140 * GIB, 140 * GIB)), 80 * GIB)
    assert heavy.status is CheckStatus.fail and "leaving nothing for the KV cache" in heavy.detail
    (cpu,) = vram_checks(profile(), GpuSnapshot(available=False, reason="no NVIDIA GPU (x)", wsl=False), 1)
    assert cpu.status is CheckStatus.na and cpu.detail == "no NVIDIA GPU (x): the engine runs on the CPU"
    (few,) = vram_checks(profile(tensor_parallel_size=2), gpus((140 * GIB, 140 * GIB)), 1)
    assert few.status is CheckStatus.fail and "needs as many GPUs; 1 visible" in few.detail


def test_vram_checks_check_every_gpu_of_the_engine_with_its_share_of_the_weights(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    host = gpus((130 * GIB, 140 * GIB), (20 * GIB, 140 * GIB), (135 * GIB, 140 * GIB), (138 * GIB, 140 * GIB))
    # No gpus named: the first two; GPU 1 lacks the memory, GPU 0 has it.
    first, second = vram_checks(profile(tensor_parallel_size=2), host, 160 * GIB)
    assert first.status is CheckStatus.ok and first.detail == (
        "GPU 0 (NVIDIA H200, rank 0): 130.0 GiB free ≥ 126.0 GiB claimed; weights 80.0 GiB per GPU (the weights' "
        "160.0 GiB split over 2 GPUs, an estimate)"
    )
    assert second.status is CheckStatus.fail and second.detail.startswith("GPU 1 (NVIDIA H200, rank 1): 20.0 GiB free")
    # The profile's gpus, in rank order: GPU 3 then GPU 2, both free.
    ranks = vram_checks(profile(tensor_parallel_size=2, gpus=[3, 2]), host, 160 * GIB)
    assert [(c.status, c.detail.split(":")[0]) for c in ranks] == [
        (CheckStatus.ok, "GPU 3 (NVIDIA H200, rank 0)"),
        (CheckStatus.ok, "GPU 2 (NVIDIA H200, rank 1)"),
    ]
    # Each GPU's share: 300 GiB over two does not fit in 0.9 × 140 GiB; over four it does.
    heavy = vram_checks(profile(tensor_parallel_size=2, gpus=[2, 3]), host, 300 * GIB)
    assert all(c.status is CheckStatus.fail and "150.0 GiB per GPU" in c.detail for c in heavy)
    assert "leaving nothing for the KV cache" in heavy[0].detail
    four = vram_checks(profile(tensor_parallel_size=4, gpus=[0, 2, 3, 1]), host, 300 * GIB)
    assert [c.status for c in four] == [CheckStatus.ok, CheckStatus.ok, CheckStatus.ok, CheckStatus.fail]
    assert "75.0 GiB per GPU" in four[0].detail
    # A GPU the host does not show is refused by name.
    missing = vram_checks(profile(tensor_parallel_size=2, gpus=[0, 7]), host, 160 * GIB)
    assert missing[1].status is CheckStatus.fail and missing[1].detail == (
        "GPU 7 (rank 1): not on this host (NVML shows GPU 0, 1, 2, 3)"
    )
    # On a CPU host: n/a, saying why, whatever the profile names.
    cpu = GpuSnapshot(available=False, reason="no NVIDIA GPU (x)", wsl=False)
    (na,) = vram_checks(profile(tensor_parallel_size=2, gpus=[0, 1]), cpu, 1)
    assert na.status is CheckStatus.na and na.detail == "no NVIDIA GPU (x): the engine runs on the CPU"


def test_the_host_rules_see_the_gpus_nvml_shows():
    assert host_gpus(gpus((1, 2), (1, 2))) == HostGpus((0, 1), None)
    absent = GpuSnapshot(available=False, reason="no NVIDIA GPU (NVML unavailable: x)", wsl=False)
    assert host_gpus(absent) == HostGpus((), "no NVIDIA GPU (NVML unavailable: x)")


def test_wsl_memory_limit_is_a_warning(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       65536000 kB\nMemFree:        1000 kB\n")
    low = wsl_memory_check(160 * GIB, meminfo)
    assert low.status is CheckStatus.warn and "raise memory= in .wslconfig" in low.detail
    assert wsl_memory_check(10 * GIB, meminfo).status is CheckStatus.ok
    assert wsl_memory_check(1, tmp_path / "missing").status is CheckStatus.warn


def test_gpu_memory_release_is_checked_after_a_stop():
    nvml = FakeNvml([FakeGpu(used=1 * GIB)])
    probe = NvmlGpus(nvml=nvml, wsl=False)
    before = probe.read()
    nvml.gpus[0].used = 1 * GIB + (100 << 20)  # within the tolerance
    assert gpu_release(before, probe, [0], wait_s=0)["status"] == "released"
    nvml.gpus[0].used = 60 * GIB
    held = gpu_release(before, probe, [0], wait_s=0.6)
    assert held == {"status": "held", "detail": "GPU 0: 59.0 GiB more in use than before the start"}
    absent = GpuSnapshot(available=False, reason="no NVIDIA GPU (NVML unavailable: x)", wsl=False)
    assert gpu_release(absent, probe, [0]) == {
        "status": "n/a",
        "detail": "no NVIDIA GPU (NVML unavailable: x): nothing to release",
    }


def test_log_tail_and_retention(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("".join(f"line {i}\n" for i in range(100_000)))
    assert tail_lines(log, 3) == ["line 99997", "line 99998", "line 99999"]
    assert tail_lines(tmp_path / "missing.log", 3) == []
    (tmp_path / "empty.log").write_text("")
    assert tail_lines(tmp_path / "empty.log", 3) == []
    for run in range(1, 6):
        run_log_path(tmp_path, run).write_text("x")
    removed = prune(tmp_path, keep=2)
    assert [p.name for p in removed] == ["run-000001.log", "run-000002.log", "run-000003.log"]
    assert sorted(p.name for p in tmp_path.glob("run-*.log")) == ["run-000004.log", "run-000005.log"]


def test_settings_name_the_variable_and_the_limit():
    settings = load_settings({})
    assert (settings.engine_grace_s, settings.log_retention, settings.install_demo) == (30.0, 20, True)
    assert load_settings({"FLASHGATE_INSTALL_DEMO": "0"}).install_demo is False
    with pytest.raises(ValueError, match="FLASHGATE_MAKE_TINY is gone: .* set FLASHGATE_INSTALL_DEMO"):
        load_settings({"FLASHGATE_MAKE_TINY": "0"})
    with pytest.raises(ValueError, match="FLASHGATE_ENGINE_GRACE_S must be a positive number, got 'soon'"):
        load_settings({"FLASHGATE_ENGINE_GRACE_S": "soon"})
    with pytest.raises(ValueError, match="FLASHGATE_LOG_RETENTION must be a positive whole number, got '0'"):
        load_settings({"FLASHGATE_LOG_RETENTION": "0"})
