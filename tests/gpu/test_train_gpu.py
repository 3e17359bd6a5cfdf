"""The demo model's training on a GPU (engine/tools/train_demo.py): replicas forked by the command line share the
GPU and train as one process does. In subprocesses: a test process that has used CUDA cannot fork replicas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_replicas_sharing_the_gpu_train_as_one_process_does(tmp_path):
    held_out = tmp_path / "qualification.md"
    held_out.write_text('## 2. Gates\n\n"a gate prompt no sample shares"\n\n## 3. After\n')
    curves = {}
    for replicas in (1, 2):
        out = tmp_path / str(replicas)
        command = [sys.executable, "-m", "engine.tools.train_demo", "--out", str(out), "--replicas", str(replicas),
                   "--held-out", str(held_out), "--no-eval", "--train-samples", "2000", "--steps", "3",
                   "--warmup-steps", "1", "--device", "cuda"]  # fmt: skip
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        log = json.loads((out / "train_log.json").read_text())
        assert log["replicas"] == replicas and (out / "model.safetensors").is_file() and log["peak_memory_bytes"] > 0
        curves[replicas] = log["curve"]
    assert [c["step"] for c in curves[2]] == [0, 1, 2]
    # The same weights and rows: the first step's losses agree (TF32 products, summed in another order).
    assert curves[2][0]["lm"] == pytest.approx(curves[1][0]["lm"], rel=1e-3)
    assert curves[2][-1]["lm"] == pytest.approx(curves[1][-1]["lm"], rel=2e-2)
