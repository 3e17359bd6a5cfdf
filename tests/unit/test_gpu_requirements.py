"""The engine refuses, at start and with the reason, a GPU whose Triton cannot compile its FP8 kernels (compute
capability below 8.9: Ampere and older), instead of failing at the first kernel's compile after the weights load."""

from __future__ import annotations

import pytest

from engine.boot import check_fp8_support


@pytest.mark.parametrize("capability", [(8, 9), (9, 0), (10, 0), (12, 0)])
def test_ada_hopper_and_blackwell_run_fp8(capability):
    check_fp8_support("NVIDIA GPU", capability, "fp8_e4m3", quant_sim=True)


@pytest.mark.parametrize(
    ("kv_dtype", "quant_sim", "weights", "named"),
    [("fp8_e4m3", True, False, "kv_cache_dtype fp8_e4m3 and quant_sim need"),
     ("fp8_e4m3", False, False, "kv_cache_dtype fp8_e4m3 needs"),
     ("bfloat16", True, False, "quant_sim needs"),
     ("bfloat16", False, True, "weight_formats as_stored (FP8 / MXFP4 weights) needs"),
     ("fp8_e4m3", True, True, "kv_cache_dtype fp8_e4m3, quant_sim and weight_formats as_stored (FP8 / MXFP4 "
                              "weights) need")],
)  # fmt: skip
def test_an_ampere_gpu_is_refused_with_what_needs_fp8(kv_dtype, quant_sim, weights, named):
    with pytest.raises(RuntimeError) as refused:
        check_fp8_support("NVIDIA RTX A6000", (8, 6), kv_dtype, quant_sim, quantized_weights=weights)
    message = str(refused.value)
    assert "NVIDIA RTX A6000 has compute capability 8.6" in message
    assert f"; {named} 8.9 or newer" in message
    assert "weight_formats dequantized" in message  # the way out is named too


def test_without_fp8_an_ampere_gpu_is_not_refused():
    check_fp8_support("NVIDIA A100-SXM4-80GB", (8, 0), "bfloat16", quant_sim=False)
