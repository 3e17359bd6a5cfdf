"""Which sparse-attention launch a GPU without one at hand would get: compiles the kernel at V4-Flash shapes for an
sm target with Triton's own ptxas (no GPU needed) and applies LAUNCHES' rule to the shared memory it reports.

Run as a module with TRITON_INTERPRET unset (a compile needs Triton's compiled kernels, not interpreted ones):
`python -m tests.engine.attention_shared_memory` prints, for each target and row kind, every launch's shared memory and
the pick, as JSON."""

from __future__ import annotations

import json

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


if __name__ == "__main__":
    print(json.dumps(picks(), indent=1))
