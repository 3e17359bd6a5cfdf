"""The sparse-attention launch each GPU gets (LAUNCHES, for many requests and for few): the first whose kernel fits
the GPU's shared memory a block.
Ada and consumer Blackwell GPUs (sm_89, sm_120) have 99 KB, where the H200's launch would need 272 KB; compiled here
for those targets with Triton's own ptxas, their pick fits. Its results on a GPU: tests/gpu/test_kernels_gpu.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.kernels.sparse_attention import LAUNCHES, first_fitting

ROOT = Path(__file__).resolve().parents[2]


def test_the_first_launch_that_fits_is_picked():
    sizes = {(64, 64, 8, 3): 214016, (16, 32, 4, 1): 81920}
    assert first_fitting(LAUNCHES[True, False], sizes.__getitem__, 232448) == (64, 64, 8, 3)
    assert first_fitting(LAUNCHES[True, False], sizes.__getitem__, 101376) == (16, 32, 4, 1)
    with pytest.raises(RuntimeError, match="49152 bytes of shared memory"):
        first_fitting(LAUNCHES[True, False], sizes.__getitem__, 49152)


@pytest.mark.slow
def test_gpus_with_99_kb_of_shared_memory_get_a_launch_that_fits():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile for a GPU, do not interpret
    done = subprocess.run([sys.executable, "-m", "tests.engine.attention_shared_memory"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    picks = json.loads(done.stdout)
    for (fp8, few), launches in LAUNCHES.items():
        table = f"{'fp8' if fp8 else 'bf16'} {'few' if few else 'many'}"
        for arch in (89, 120):
            got = picks[f"sm_{arch} {table}"]
            assert got["shared"][str(got["pick"])] <= got["limit"], got
            if not few:  # the H200's 64-head launch would not start there
                assert got["shared"][str(list(launches[0]))] > got["limit"], got
        assert picks[f"sm_90 {table}"]["pick"] == list(launches[0])


@pytest.mark.slow
def test_quant_kernels_fit_99_kb_of_shared_memory():
    """The FP8 linears' and FP4 (MXFP4, NVFP4) experts' kernels compile for sm_89, sm_90 and sm_120 at V4-Flash
    shapes (the experts' at decode and prefill tiles: three tilings each), each launch within the target's shared
    memory a block."""
    from tests.engine.attention_shared_memory import TARGETS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from tests.engine.attention_shared_memory import TARGETS, quant_kernel_shared_bytes; "
            "print(json.dumps({a: quant_kernel_shared_bytes(a) for a in TARGETS}))")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    for arch, kernels in json.loads(done.stdout).items():
        assert len(kernels) == 17 and all(0 < shared <= TARGETS[int(arch)] for shared in kernels.values()), kernels
