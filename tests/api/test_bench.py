"""The benchmarks meant for the H200 keep working: their CPU smoke runs on the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.tools.make_tiny import TINY_CONFIG
from tests.support import ROOT

pytestmark = pytest.mark.slow


def test_the_serving_benchmark_smoke_run(tmp_path):
    out = tmp_path / "smoke.json"
    done = subprocess.run(
        [sys.executable, "bench/serve.py", "--smoke", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "output tok/s" in done.stdout and "TTFT ms" in done.stdout and "engine exited with 0" in done.stderr
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 8 and summary["failed"] == 0 and summary["output_tokens_per_s"] > 0
    # From the engine's /metrics: per MoE layer of the tiny model (8 experts, top-2), the mean distinct experts a decode
    # step of up to 4 requests read.
    assert summary["decode_steps"] > 0 and len(summary["decode_experts_touched"]) == 6
    assert all(1 <= touched <= 8 for touched in summary["decode_experts_touched"])


def test_the_prefix_cache_benchmark_smoke_run(tmp_path):
    """bench/prefix.py's machinery on the tiny model: both engines, the sessions, the burst, the report's figures."""
    done = subprocess.run([sys.executable, "bench/prefix.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "prefix.json").read_text())
    summary, turns = report["summary"], report["cache_on"]["tool_session"]
    assert report["cache_on"]["prefix_cache"]["enabled"] and not report["cache_off"]["prefix_cache"]["enabled"]
    assert len(turns) == 8 and all(t["cached_tokens"] > 0 for t in turns[1:])
    assert all(t["cached_tokens"] == 0 for t in report["cache_off"]["tool_session"])
    assert 0 < summary["session_hit_rate"] < 1 and 0 < summary["burst_cached_fraction"] < 1
    assert summary["turn_ttft_ratio"] > 0 and summary["decode_ratio_cache_on"] > 0
    assert "turn_ttft_ratio" in (tmp_path / "prefix.md").read_text()
    # the engine's own TTFT per turn, from its log: arrival to first token, within the client's
    for run in (report["cache_on"], report["cache_off"]):
        assert all(0 < t["engine_ttft_s"] <= t["ttft_s"] for t in run["tool_session"] + run["thinking_session"])
    assert summary["engine_turn_ttft_ratio"] > 0 and summary["front_end_ttft_s"] >= 0
    # V4-Flash's shipped formats by default, through their own kernels' references
    assert report["weights"] == "official" and '"routed_experts": "Mxfp4Experts"' in (
        tmp_path / "prefix-engine-on.log").read_text()  # fmt: skip


def test_the_host_ops_count_smoke_run(tmp_path):
    """bench/host_ops.py on the tiny model: each layer kind's ops and launches counted, and no layer of a prefill or
    decode step waits for the device (a host sync in a layer would stall every step)."""
    done = subprocess.run([sys.executable, "bench/host_ops.py", "--smoke", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "host-ops.json").read_text())
    for name in ("prefill", "decode"):
        step = report["steps"][name]
        assert set(step["per_layer_kind"]) == {"window", "c4", "c128"}
        for kind, counts in step["per_layer_kind"].items():
            assert counts["sync"] == 0, (name, kind)
            assert counts["triton"] > 0 and counts["torch"] > 0, (name, kind)
        assert step["top_functions"] and step["top_lines"]
    # c4 layers launch the most: the indexer and its compressor on top of what c128 layers do
    decode = report["steps"]["decode"]["per_layer_kind"]
    assert decode["c4"]["triton"] > decode["c128"]["triton"] > decode["window"]["triton"]
    assert "host syncs" in (tmp_path / "host-ops.md").read_text()


def test_the_demo_training_step_smoke_run(tmp_path):
    """bench/demo_train.py on the tiny model: both c4 modes timed and profiled; the ops a step runs are counted;
    whole runs in one and two replicas timed (MPS asked for, and said to be missing without a GPU)."""
    done = subprocess.run([sys.executable, "bench/demo_train.py", "--smoke", "--steps", "1", "--samples", "40",
                           "--replicas", "1,2", "--row-tokens", "1024,2048", "--mps", "--out", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "demo-train.json").read_text())
    assert set(report["phases"]) == {"dense", "sparse", "sparse, references only"}
    assert report["commit"] and report["device"] == "CPU"
    for phase in report["phases"].values():
        # a step holds at most its 2,048 tokens, in as many rows of up to 1,024 as its samples pack into
        assert 0 < phase["tokens_per_step"] <= 2048 and phase["tok_s"] > 0
        assert phase["rows_per_step"] >= phase["tokens_per_step"] / 1024
        assert phase["host_ops"] > 1000 and len(phase["top_host_ops"]) == 12
    assert [(r["replicas"], r["row_tokens"], r["mps"]) for r in report["scaling"]] == [
        (1, 1024, False),
        (1, 2048, False),
        (2, 1024, False),
        (2, 2048, False),
    ]
    assert report["scaling"][0]["vs_one"] == 1 and all(r["tok_s"] > 0 for r in report["scaling"])
    assert report["mps_missing"] == "no GPU"
    assert "| dense |" in (tmp_path / "demo-train.md").read_text()


def _mps_control_stand_in(tmp_path, monkeypatch) -> Path:
    """A stand-in for nvidia-cuda-mps-control (no GPU here) first on PATH, appending how it was called to the
    returned file; it exits with $FAIL."""
    calls = tmp_path / "calls"
    control = tmp_path / "bin" / "nvidia-cuda-mps-control"
    control.parent.mkdir()
    control.write_text(
        f'#!/bin/sh\necho "$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> {calls}\nexit "${{FAIL:-0}}"\n'
    )
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{control.parent}:{os.environ['PATH']}")
    return calls


def test_the_mps_daemon_is_started_for_the_runs_and_quit_after(tmp_path, monkeypatch):
    """bench/demo_train.py's MPS window: the control daemon started with `-d` and the pipe and log folders, the
    folders in the environment meanwhile (forked replicas inherit them), `quit` on its stdin after; a daemon that
    will not start is the reason given instead."""
    from bench.demo_train import mps_daemon

    calls = _mps_control_stand_in(tmp_path, monkeypatch)
    with mps_daemon(tmp_path / "mps") as missing:
        assert missing is None and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "mps" / "pipe")
        assert (tmp_path / "mps" / "log").is_dir()
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    started, quit_ = calls.read_text().splitlines()
    assert started == f"-d pipe={tmp_path / 'mps' / 'pipe'} stdin=" and quit_.endswith("stdin=quit")

    monkeypatch.setenv("FAIL", "3")
    with mps_daemon(tmp_path / "mps") as missing:
        assert missing.startswith("nvidia-cuda-mps-control -d failed (3)")
    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with mps_daemon(tmp_path / "mps") as missing:
        assert missing == "nvidia-cuda-mps-control is not installed"


def test_runs_that_fail_under_mps_leave_the_runs_without_it(tmp_path, monkeypatch):
    """A replica that cannot use MPS (here: any run while the daemon's variables are set) fails its run: the runs
    without MPS are still timed, and the failure is the reason MPS was not measured."""
    import bench.demo_train as bench
    from engine.tools import demo_data

    _mps_control_stand_in(tmp_path, monkeypatch)
    real = bench.train

    def train(*args, **kwargs):
        if "CUDA_MPS_PIPE_DIRECTORY" in os.environ:
            raise RuntimeError("replica 0 of 2 failed: CUDA error: all CUDA-capable devices are busy or unavailable")
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "train", train)
    recipe = bench.Recipe(max_tokens=1024, row_tokens=1024, tokens_per_step=2048, config=dict(TINY_CONFIG))
    runs, missing = bench.scaling(recipe, torch.device("cpu"), [1, 2], [1024], 1, 40, demo_data.QUALIFICATION_MD, True)
    assert [(r["replicas"], r["mps"]) for r in runs] == [(1, False), (2, False)]
    assert missing.startswith("a run under MPS failed: replica 0 of 2 failed: CUDA error")


def test_the_demo_model_record_of_a_run_that_spans_calls(tmp_path):
    """bench/demo_model.py on a tiny run trained in two calls (the second resumed from the first's checkpoint): the
    steps of the whole run, each call's steps and schedule (what reproduces it), the accuracy evaluated here on the
    CPU for a checkpoint brought back without one, held out and on fresh training-split samples (kept in its
    eval.json with their answers), and the loss chart."""
    import dataclasses

    from engine.tools import demo_data
    from engine.tools.train_demo import Recipe, differentiable_kernels, train

    recipe = Recipe(train_samples=7, eval_per_task=1, max_tokens=2048, row_tokens=2048, tokens_per_step=2500, steps=3,
                    warmup_steps=1, config=dict(TINY_CONFIG))  # fmt: skip
    cpu = torch.device("cpu")
    with differentiable_kernels():
        train(recipe, tmp_path / "first", cpu, stop_after_s=1e-9)  # ends after its first step
        train(dataclasses.replace(recipe, init=str(tmp_path / "first"), first_step=1), tmp_path / "run", cpu)
    done = subprocess.run([sys.executable, "bench/demo_model.py", "--run", str(tmp_path / "run"), "--commit", "abc1234",
                           "--train-split", "1", "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "demo-model.json").read_text())
    assert result["steps"] == 3 and result["commit"] == "abc1234" and set(result["accuracy"]) == set(demo_data.TASKS)
    split = result["train_split"]
    assert split["per_task"] == 1 and set(split["accuracy"]) == set(demo_data.TASKS)
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["train_split"] == split
    answers = [json.loads(line) for line in (tmp_path / "run" / "train_answers.jsonl").read_text().splitlines()]
    assert len(answers) == len(demo_data.TASKS) and all(a["id"].startswith("train-") for a in answers)
    assert [(c["first_step"], c["last_step"], c["recipe"]["first_step"]) for c in result["calls"]] == [
        (0, 0, 0),
        (1, 2, 1),
    ]
    md = (tmp_path / "demo-model.md").read_text()
    assert "3 steps of up to 2,500 tokens (rows of 2,048)" in md and "| 2 | 1–2 | 3 | 7 | 1 | 1 |" in md
    assert "| task | accuracy | training split | issue 31's bar |" in md
    placed = result["retrieval_by_window"]  # the one retrieval prompt of each split, on one side of the window
    assert result["window"] == TINY_CONFIG["sliding_window"]
    assert {name: sum(n for _, n in by.values()) for name, by in placed.items()} == {"held_out": 1, "train_split": 1}
    assert "Retrieval by where the needle lies, within the 16-token sliding window" in md
    lookup = result["needle_lookup"]  # the tiny model's c4 layers
    assert set(lookup) == {str(i) for i, ratio in enumerate(TINY_CONFIG["compress_ratios"]) if ratio == 4}
    for figures in lookup.values():
        assert figures["prompts"] > 0 and 0 < figures["uniform"] < 1
        assert all(0 <= figures[k] <= 1 for k in ("indexer_recall", "attention_mass", "best_head_mass"))
    assert "**The long-context path** (" in md
    assert (tmp_path / "demo-model.svg").read_text().startswith("<")
