"""Which sparse-attention launch a GPU without one at hand would get: compiles the kernel at V4-Flash shapes for an
sm target with Triton's own ptxas (no GPU needed) and applies LAUNCHES' rule to the shared memory it reports.

Run as a module with TRITON_INTERPRET unset (a compile needs Triton's compiled kernels, not interpreted ones):
`python -m tests.engine.attention_shared_memory` prints, for each target and row kind, every launch's shared memory and
the pick, as JSON."""

from __future__ import annotations

import itertools
import json
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engine.kernels.sparse_attention import LAUNCHES, Launch, _sparse_attention_kernel, first_fitting

# shared memory a block may use (CUDA's tables for these compute capabilities)
TARGETS = {89: 101376, 90: 232448, 120: 101376}


def shared_bytes(launch: Launch, arch: int, fp8: bool) -> int:
    head_block, block_n, num_warps, num_stages = launch
    rows = "*u8" if fp8 else "*bf16"
    signature = dict(
        q_ptr="*bf16", win_ptr=rows, comp_ptr=rows, seq_slot_ptr="*i32", pos_ptr="*i32", cslots_ptr="*i32",
        clen_ptr="*i32", o_part_ptr="*fp32", lse_part_ptr="*fp32", sink_ptr="*fp32", out_ptr="*bf16",
        stride_qb="i32", stride_qh="i32", stride_cb="i32", stride_ob="i32", stride_oh="i32", scale_log2="fp32",
    )  # fmt: skip
    constexprs = dict(H=64, HB=head_block, D=512, NOPE=448, W=128, R_COMP=64, BN=block_n, SPLITS=2, FP8=fp8,
                      F32_DOT=False, WINDOW_SPAN=False)  # fmt: skip
    names = list(signature) + list(constexprs)
    # as a launch specialises them: pointers and strides 16-aligned
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in signature if n.endswith("ptr") or "stride" in n}
    signature.update(dict.fromkeys(constexprs, "constexpr"))
    source = ASTSource(_sparse_attention_kernel, signature, constexprs=constexprs, attrs=attrs)
    kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
    return kernel.metadata.shared


def picks() -> dict:
    """Keyed "sm_89 fp8 many" (row kind, then many or few requests)."""
    out = {}
    for arch, limit in TARGETS.items():
        for (fp8, few), launches in LAUNCHES.items():
            shared = {launch: shared_bytes(launch, arch, fp8) for launch in launches}
            pick = first_fitting(launches, shared.__getitem__, limit)
            out[f"sm_{arch} {'fp8' if fp8 else 'bf16'} {'few' if few else 'many'}"] = dict(
                limit=limit, pick=list(pick), shared={str(list(k)): v for k, v in shared.items()}
            )
    return out


# The FP8 linears' and MXFP4 experts' kernels at V4-Flash shapes, compiled the same way: their launches as the
# wrappers make them on each target (the prefill GEMM's pipelining depth from the target's shared memory).
def quant_kernel_shared_bytes(arch: int) -> dict[str, int]:
    from engine.kernels import fp8_gemm as fp8
    from engine.kernels.fp4_moe import _fp4_down_kernel, _fp4_gate_up_kernel, expert_tiles

    def compile_shared(fn, signature, constexprs, num_warps, num_stages):
        names = list(signature) + list(constexprs)
        # as a launch specialises them at these shapes: pointers, strides and K 16-aligned
        aligned = [n for n in signature if n.endswith("ptr") or "stride" in n or n == "K"]
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        signature = dict(signature, **dict.fromkeys(constexprs, "constexpr"))
        source = ASTSource(fn, signature, constexprs=constexprs, attrs=attrs)
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))  # fmt: skip
        return kernel.metadata.shared

    device = types.SimpleNamespace(type="cuda")
    out = {}
    for m, block_n in ((1, 64), (16, 64), (64, 128)):  # activations quantized first, in registers, first
        quantized = m == 1 or m > fp8.QUANTIZE_FIRST_M
        out[f"fp8 decode M={m}"] = compile_shared(fp8._decode_kernel, dict(
            x_ptr="*fp8e4nv" if quantized else "*bf16", sa_ptr="*fp32" if quantized else "*bf16", w_ptr="*fp8e4nv",
            s_ptr="*u8", out_ptr="*bf16", part_ptr="*fp32", counter_ptr="*i32", M="i32", K="i32",
            kb_per_split="i32", stride_xm="i32", stride_xg="i32", stride_sam="i32", stride_sag="i32", stride_wn="i32",
            stride_s="i32", stride_om="i32", stride_ps="i32",
        ), dict(R=4096, TILES=4096 // block_n, E8M0=True, QUANTIZED=quantized, SPLITS=4,
                BLOCK_M=max(16, m),
                BLOCK_N=block_n, F32_DOT=False, TINY=fp8.FP8_TINY, UNIFORM_SCALE=True), 4,
            on_target(arch, fp8.decode_stages, device, m))  # fmt: skip
    out["fp8 quantize"] = compile_shared(fp8._quantize_kernel, dict(
        x_ptr="*bf16", codes_ptr="*fp8e4nv", scale_ptr="*fp32", rows="i32", K="i32", stride_x="i32",
    ), dict(ROWS=32, TINY=fp8.FP8_TINY, EXACT_CAST=False), 4, 1)  # fmt: skip
    out["fp8 prefill"] = compile_shared(fp8._prefill_kernel, dict(
        a_ptr="*fp8e4nv", sa_ptr="*fp32", w_ptr="*fp8e4nv", s_ptr="*u8", out_ptr="*bf16", M="i32", K="i32",
        stride_am="i32", stride_ag="i32", stride_sam="i32", stride_sag="i32", stride_wn="i32", stride_s="i32",
        stride_om="i32", stride_og="i32",
    ), dict(R=4096, E8M0=True, GROUP_M=8, BLOCK_M=128, BLOCK_N=128, F32_DOT=False, UNIFORM_SCALE=True), 8,
        on_target(arch, fp8.prefill_stages, device))  # fmt: skip
    tiles = [on_target(arch, expert_tiles, tokens, tokens * 6, 256, device) for tokens in (16, 64, 8192)]
    tiles = [t for i, t in enumerate(tiles) if t not in tiles[:i]]  # decode's, and prefill's where they differ
    for (layout, group, nv), t in itertools.product((("mxfp4", 32, False), ("nvfp4", 16, True)), tiles):
        block_m, name = t["block_m"], f"BLOCK_M={t['block_m']} BLOCK_I={t['block_i']}"
        out[f"{layout} gate_up {name}"] = compile_shared(_fp4_gate_up_kernel, dict(
            x_ptr="*bf16", w1_ptr="*i16", s1_ptr="*u8", g1_ptr="*fp32", w3_ptr="*i16", s3_ptr="*u8", g3_ptr="*fp32",
            pair_ptr="*i64", weights_ptr="*fp32", active_ptr="*i64", offsets_ptr="*i64", h_ptr="*bf16",
            part_ptr="*fp32", counter_ptr="*i32", stride_xn="i32", stride_we="i32", stride_wi="i32", stride_se="i32",
            stride_si="i32", stride_hm="i32", stride_ps="i32", limit="fp32",
        ), dict(E=256, TOP_K=6, D=4096, INTER=2048, CLAMP=True, G=group, NV=nv, SPLITS=2, BLOCK_M=block_m,
                BLOCK_I=t["block_i"], BLOCK_K=128, H_BLOCK_K=128, F32_DOT=False, BF16X2=not nv),
            t["num_warps"], 3)  # fmt: skip
        out[f"{layout} down {name}"] = compile_shared(_fp4_down_kernel, dict(
            h_ptr="*bf16", w2_ptr="*i16", s2_ptr="*u8", g2_ptr="*fp32", pair_ptr="*i64", active_ptr="*i64",
            offsets_ptr="*i64", y_ptr="*bf16", part_ptr="*fp32", counter_ptr="*i32", stride_hm="i32",
            stride_we="i32", stride_wd="i32", stride_se="i32", stride_sd="i32", stride_ym="i32", stride_ps="i32",
        ), dict(E=256, D=4096, INTER=2048, G=group, NV=nv, SPLITS=2, BLOCK_M=block_m, BLOCK_D=t["block_d"],
                BLOCK_K=128, F32_DOT=False, BF16X2=not nv), t["num_warps"], 3)  # fmt: skip
    return out


def on_target(arch: int, pick, *args) -> int:
    """A launch rule's pick (pick(*args)) on a GPU of the target's shared memory a block."""
    from unittest import mock

    with (mock.patch("engine.kernels.fp8_gemm.shared_memory_limit", return_value=TARGETS[arch]),
          mock.patch("engine.kernels.fp4_moe.shared_memory_limit", return_value=TARGETS[arch])):  # fmt: skip
        return pick(*args)


if __name__ == "__main__":
    print(
        json.dumps({**picks(), **{f"sm_{arch} quant": quant_kernel_shared_bytes(arch) for arch in TARGETS}}, indent=1)
    )
