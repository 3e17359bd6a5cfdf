"""The routed experts' grouped GEMM over FP4 weights kept packed in GPU memory, in the two layouts checkpoints ship:
MXFP4 as the official checkpoint stores it (reference §9: packed e2m1 pairs, low nibble = the even element, one ue8m0
scale per 32 values) and NVFP4 as NVIDIA's ModelOpt checkpoint stores it (the same codes, one e4m3 scale per 16 values
and one fp32 global scale per expert and projection; docs/quantized-weights.md cites the names).

The same pipeline as the bf16 path in engine/kernels/moe.py, whose counting sort and pair order it reuses: pairs
grouped by expert, then a gate/up launch (clamped SwiGLU and the routing weight fused, h in x's dtype) and a down
launch over the active experts only, each program reading its expert's weight tile once per BLOCK_M pairs. Every
shape depends on N, k and E only and nothing goes to the host, so a CUDA graph captured for a batch size replays with
any routing.

W4A16: the codes are upcast to x's dtype (bf16) in registers and meet the activations on the bf16 tensor cores.
Hopper has no FP4 tensor cores; the alternative, W4A8 (e2m1 -> e4m3 is exact), would run the FP8 tensor cores but
the per-block weight scale then applies either to a K=32 (or 16) partial sum per token (an fp32 multiply-add per
token and block, as much work as the upcast at batch 32) or not exactly, and the activations would be rounded to e4m3
where the bf16 path keeps them; decode streams weights, so the MMA rate that W4A8 doubles is not what limits it, and
the conversion costs the same bit operations either way. On the H200 the kernel is bound by the instructions that
unpack and upcast the codes (about five a value, four warps' issue rate: bench/results/quant.md), not by the MMA rate
W4A8 would double; so the upcast itself was made cheaper (_E2M1_TO_BF16X2: 0.75-0.8x the e4m3 route's time).

MXFP4 into bf16 takes _E2M1_TO_BF16X2 (bit-exact for every scale byte). Otherwise (NVFP4, fp32 activations, the
interpreter) the upcast is a handful of integer operations a code and no table: the nibble's sign, exponent and mantissa
bits placed into e4m3 bits (sign -> bit 7, e and m -> bits 2-4) give exactly the e2m1 value times 2**-6 (0.5 lands on an
e4m3 subnormal), the hardware's e4m3 conversion makes it fp32, and one multiply by the block's factor restores it:
2**(scale - 121) for a ue8m0 scale (exact: a power of two), fl32(scale x global) x 2**6 for NVFP4 (the 2**6 exact, so
the product is the reference's code x fl32(scale x global)). ue8m0 scales up to 2**121 (bytes <= 248) are exact; the
checkpoint's are near 2**-10.

The codes are read as 16-bit words, four codes a word, and each K tile's dot is split into four K phases (phase p: the
values at K = 4j + p, nibble p of word j), so no shuffle puts values back in order: each thread's words reach the MMA
operand's registers by ldmatrix, two neighbouring words a register, and every upcast instruction makes finished bf16
pairs. The activations arrive phase-major (each tile's phase 0, then 1, 2, 3: x rearranged by one copy, h so written by
the gate/up launch), so each phase's tile is contiguous and Triton pipelines it beside the codes. sm_90 SASS of the
gate/up loop at BLOCK_M 16: 535 instructions a K step of 128 (down: 307 for half the values), against 684 (157 of them
byte permutes) when bytes were the unit, the dot split in two and the activations loaded two bytes at a time.

The weights are taken in the checkpoint's layout (`PackedFp4`): w1, w3 [E, I, D/2] (uint8 or int8) with scales
[E, I, D/g] and w2 [E, D, I/2] with [E, D, I/g] (g = 32 for ue8m0 scales, 16 for e4m3 ones, which come with a global
scale [E]), K contiguous: each program reads rows of g/2 bytes for each g values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.dispatch import interpreting, multiprocessors, shared_memory_limit, use_triton
from engine.kernels.moe import _dot, moe_expert_pairs_reference, sort_pairs
from engine.kernels.quant import NVFP4_BLOCK, dequantize_fp4_weight, dequantize_nvfp4_weight
from engine.kernels.scales import pow2
from engine.kernels.split_k import arrives_last, tile_counters

MX_BLOCK = 32  # values per ue8m0 scale
PROGRAMS_PER_SM = 3  # the expert kernels' programs a multiprocessor holds at once (their registers allow three)
# A program upcasts its weight tile once per BLOCK_M pairs. Where an expert gets more pairs than one 64-pair tile on
# average (prefill chunks of more than ~2700 tokens at 6 of 256 experts), 128 x 128 tiles in 8 warps upcast each code
# once per 128 pairs: 1.35-1.42x faster at 4096 and 8192 tokens on the H200 (1.5-1.6x on the H100), slower up to 48
# pairs an expert (bench/quant.py's prefill chunks). Their 3 stages take up to 160 KB of shared memory: Hopper's 227 KB
# only.
LARGE_TILES = {"block_m": 128, "block_i": 128, "block_d": 128, "num_warps": 8}


@dataclass(frozen=True)
class PackedFp4:
    """One projection of E experts as stored: codes [E, R, C/2], block scales [E, R, C/g] (ue8m0, g = 32: MXFP4; or
    e4m3, g = 16: NVFP4) and, for NVFP4, the global scales [E] (fp32)."""

    codes: torch.Tensor
    scale: torch.Tensor
    global_scale: torch.Tensor | None = None

    @property
    def block(self) -> int:
        return MX_BLOCK if self.global_scale is None else NVFP4_BLOCK

    def dequantized(self, experts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The experts `experts` as [len(experts), R, C] floats of `dtype` (exact in fp32 and wider)."""
        if self.global_scale is None:
            return dequantize_fp4_weight(self.codes[experts], self.scale[experts], dtype)
        return dequantize_nvfp4_weight(self.codes[experts], self.scale[experts],
                                       self.global_scale[experts, None, None], dtype)  # fmt: skip


def moe_expert_pairs_fp4_reference(x, weights, ids, w1: PackedFp4, w3: PackedFp4, w2: PackedFp4, limit,
                                   touched=None, remote=False):  # fmt: skip
    """x [N, D]; weights [N, k] fp32; ids [N, k]; w1, w3 [E, I, D] and w2 [E, D, I] packed -> [N * k, D] in x's dtype:
    moe_expert_pairs_reference over the picked experts' weights dequantized to x's dtype (an id of E, another rank's
    expert, the last of them: a zero row)."""
    experts, local = torch.unique(ids, return_inverse=True)
    experts = experts[experts < len(w1.codes)]
    return moe_expert_pairs_reference(
        x, weights, local, w1.dequantized(experts, x.dtype), w3.dequantized(experts, x.dtype),
        w2.dequantized(experts, x.dtype), limit, touched,
    )  # fmt: skip


# MXFP4 codes to bf16 in PTX (sm_80 and later), two 16-bit code words (8 values) a call. Nibble p of each word is the
# value at K phase p (the word holds K = 4j .. 4j + 3): its sign moved to bit 15 and its exponent and mantissa bits to
# bits 6-8 of a bf16 lane — both words' at once, one per 16-bit half — makes the lane the e2m1 value times 2**-126,
# exactly (0.5 lands on a bf16 subnormal); one bf16x2 FMA by 2**126 and one by the block's 2**(scale - 127), both
# exact (-0 added keeps the zeros' signs), give phase p of both words in output p. The words arrive in the MMA
# operand's registers as loaded (two neighbouring K words a register), so no byte is moved before or after.
_E2M1_TO_BF16X2 = tl.constexpr("""{
    .reg .b32 t, u, z, bias;
    mov.b32 z, 0x80008000;
    mov.b32 bias, 0x7E807E80;
    shl.b32 t, $4, 12; and.b32 t, t, 0x80008000; shl.b32 u, $4, 6; and.b32 u, u, 0x01C001C0; or.b32 t, t, u;
    fma.rn.bf16x2 t, t, bias, z; fma.rn.bf16x2 $0, t, $5, z;
    shl.b32 t, $4, 8; and.b32 t, t, 0x80008000; shl.b32 u, $4, 2; and.b32 u, u, 0x01C001C0; or.b32 t, t, u;
    fma.rn.bf16x2 t, t, bias, z; fma.rn.bf16x2 $1, t, $5, z;
    shl.b32 t, $4, 4; and.b32 t, t, 0x80008000; shr.b32 u, $4, 2; and.b32 u, u, 0x01C001C0; or.b32 t, t, u;
    fma.rn.bf16x2 t, t, bias, z; fma.rn.bf16x2 $2, t, $5, z;
    and.b32 t, $4, 0x80008000; shr.b32 u, $4, 6; and.b32 u, u, 0x01C001C0; or.b32 t, t, u;
    fma.rn.bf16x2 t, t, bias, z; fma.rn.bf16x2 $3, t, $5, z;
}""")


@triton.jit
def _phase_to_e4m3(nibble):
    """e2m1 codes (int16, the low four bits) -> the e4m3 code of their value times 2**-6."""
    return (((nibble << 4) & 0x80) | ((nibble << 2) & 0x1C)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _upcast(words, scale, global_scale, NV: tl.constexpr, DTYPE: tl.constexpr, BF16X2: tl.constexpr):
    """words int16 [ROWS, B, g/4] (B blocks of g values, four codes a word), scale uint8 [ROWS, B] (ue8m0 bytes, or
    e4m3 bytes when NV, with the expert's fp32 `global_scale`) -> the four K phases [ROWS, B * g/4] in DTYPE: phase p
    holds the values at K = 4j + p.

    BF16X2 (MXFP4 into bf16, on a GPU): _E2M1_TO_BF16X2. Otherwise the nibble's bits placed into e4m3 bits (sign ->
    bit 7, e and m -> bits 2-4) give the e2m1 value times 2**-6, e4m3 -> fp32, the scaling multiply in fp32, then
    DTYPE: Triton 3.6 converts e4m3 to bf16 through an instruction sm_89 lacks, and its interpreter's bf16 products are
    wrong."""
    rows: tl.constexpr = words.shape[0]
    width: tl.constexpr = words.shape[1] * words.shape[2]
    if BF16X2:
        # 2**(scale - 127) as bf16: the exponent field, or the subnormal 2**-127 for a zero byte
        factor = tl.where(scale > 0, scale.to(tl.int16) << 7, 0x40).to(tl.int16).to(tl.bfloat16, bitcast=True)
        factor = tl.broadcast_to(factor[:, :, None], words.shape)
        p0, p1, p2, p3 = tl.inline_asm_elementwise(
            _E2M1_TO_BF16X2, "=r,=r,=r,=r,r,r", [words, factor], dtype=(tl.bfloat16,) * 4, is_pure=True, pack=2
        )
    else:
        if NV:
            factor = (scale.to(tl.float8e4nv, bitcast=True).to(tl.float32) * global_scale * 64.0)[:, :, None]
        else:
            factor = pow2(scale.to(tl.int32) - 121)[:, :, None]
        p0 = (_phase_to_e4m3(words).to(tl.float32) * factor).to(DTYPE)
        p1 = (_phase_to_e4m3(words >> 4).to(tl.float32) * factor).to(DTYPE)
        p2 = (_phase_to_e4m3(words >> 8).to(tl.float32) * factor).to(DTYPE)
        p3 = (_phase_to_e4m3(words >> 12).to(tl.float32) * factor).to(DTYPE)
    shape: tl.constexpr = (rows, width)
    return tl.reshape(p0, shape), tl.reshape(p1, shape), tl.reshape(p2, shape), tl.reshape(p3, shape)


@triton.jit
def _fp4_tile_offsets(e, rows, stride_we, stride_wr, stride_se, stride_sr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """Offsets of one expert's code tile [rows, BLOCK_K/G, G/4] (16-bit words) and scale tile [rows, BLOCK_K/G]
    (bytes) at K = 0; the code strides count words."""
    blocks = tl.arange(0, BLOCK_K // G)
    word = tl.arange(0, G // 4)
    codes = (e.to(tl.int64) * stride_we + rows[:, None, None] * stride_wr + blocks[None, :, None] * (G // 4)
             + word[None, None])  # fmt: skip
    scales = e.to(tl.int64) * stride_se + rows[:, None] * stride_sr + blocks[None, :]
    return codes, scales


@triton.jit
def _load_phases(ptrs, k, mask, BLOCK_K: tl.constexpr):
    """The four K phases of an activation tile stored phase-major (phase_major): ptrs [BLOCK_K/4, M] at the tile's
    phase 0, k the tile's start."""
    a0 = tl.load(ptrs + k, mask=mask, other=0.0)
    a1 = tl.load(ptrs + k + BLOCK_K // 4, mask=mask, other=0.0)
    a2 = tl.load(ptrs + k + BLOCK_K // 2, mask=mask, other=0.0)
    a3 = tl.load(ptrs + k + 3 * BLOCK_K // 4, mask=mask, other=0.0)
    return a0, a1, a2, a3


@triton.jit
def _phase_major(i, BLOCK_K: tl.constexpr):
    """Where K index i lives in a phase-major row: within its tile of BLOCK_K, phase i % 4 first, then i // 4."""
    within = i % BLOCK_K
    return i - within + (within % 4) * (BLOCK_K // 4) + within // 4


@triton.jit
def _dot_phases(w0, w1, w2, w3, a0, a1, a2, a3, acc, F32_DOT: tl.constexpr):
    """acc + the four K phases' products: w_p [R, K/4] x a_p [K/4, M]."""
    return _dot(w3, a3, _dot(w2, a2, _dot(w1, a1, _dot(w0, a0, acc, F32_DOT), F32_DOT), F32_DOT), F32_DOT)


@triton.jit
def _swiglu_store(gate, up, pair, rows, valid, weights_ptr, h_ptr, stride_hm, i, limit, CLAMP: tl.constexpr,
                  H_BLOCK_K: tl.constexpr):  # fmt: skip
    """h rows = routing weight x swiglu(gate, up), clamped as the reference, in h's dtype, phase-major by the down
    launch's K tile (H_BLOCK_K)."""
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up * tl.load(weights_ptr + pair, mask=valid, other=0.0)[None, :]
    at = _phase_major(i, H_BLOCK_K)
    tl.store(h_ptr + rows[None, :] * stride_hm + at[:, None], h.to(h_ptr.dtype.element_ty), mask=valid[None, :])


@triton.jit
def _fp4_gate_up_kernel(
    x_ptr, w1_ptr, s1_ptr, g1_ptr, w3_ptr, s3_ptr, g3_ptr, pair_ptr, weights_ptr, active_ptr, offsets_ptr, h_ptr,
    part_ptr, counter_ptr, stride_xn, stride_we, stride_wi, stride_se, stride_si, stride_hm, stride_ps, limit,
    E: tl.constexpr, TOP_K: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, CLAMP: tl.constexpr, G: tl.constexpr,
    NV: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
    H_BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, BF16X2: tl.constexpr,
):  # fmt: skip
    """moe._gate_up_kernel over packed weights: one expert's rows [tile * BLOCK_I, +BLOCK_I) of w1 and w3 against all
    of that expert's pairs over K split `program_id(2)` of SPLITS, transposed (weights as the dot's M side). g1, g3:
    the global scales when NV. With K split, gate and up go to part [SPLITS, pairs, 2 * INTER] (fp32) and the tile's
    last program adds them before the SwiGLU (split_k)."""
    e = tl.load(active_ptr + tl.program_id(0))
    if e < E:
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        g1 = tl.load(g1_ptr + e) if NV else 1.0
        g3 = tl.load(g3_ptr + e) if NV else 1.0
        i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
        w_offs, s_offs = _fp4_tile_offsets(e, i, stride_we, stride_wi, stride_se, stride_si, BLOCK_K, G)
        quarter = tl.arange(0, BLOCK_K // 4)
        dtype = h_ptr.dtype.element_ty
        k_start = tl.program_id(2) * (D // SPLITS)
        k_last = k_start + D // SPLITS - BLOCK_K
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            valid = rows < end
            pair = tl.load(pair_ptr + rows, mask=valid, other=0)
            # x phase-major ([BLOCK_K / 4, BLOCK_M] a phase, K contiguous): Triton pipelines it with the codes
            x_ptrs = x_ptr + (pair // TOP_K)[None, :] * stride_xn + quarter[:, None]
            gate = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
            up = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
            # the scales feed registers, which Triton does not pipeline: each is issued a K step ahead
            sc1, sc3 = tl.load(s1_ptr + s_offs + k_start // G), tl.load(s3_ptr + s_offs + k_start // G)
            for k0 in range(k_start, k_last + BLOCK_K, BLOCK_K):
                k1 = tl.minimum(k0 + BLOCK_K, k_last)  # the next step's (the last step reloads its own)
                sc1_next, sc3_next = tl.load(s1_ptr + s_offs + k1 // G), tl.load(s3_ptr + s_offs + k1 // G)
                x0, x1, x2, x3 = _load_phases(x_ptrs, k0, valid[None, :], BLOCK_K)
                g0, g1_, g2, g3_ = _upcast(tl.load(w1_ptr + w_offs + k0 // 4), sc1, g1, NV, dtype, BF16X2)
                gate = _dot_phases(g0, g1_, g2, g3_, x0, x1, x2, x3, gate, F32_DOT)
                u0, u1, u2, u3 = _upcast(tl.load(w3_ptr + w_offs + k0 // 4), sc3, g3, NV, dtype, BF16X2)
                up = _dot_phases(u0, u1, u2, u3, x0, x1, x2, x3, up, F32_DOT)
                sc1, sc3 = sc1_next, sc3_next
            if SPLITS > 1:
                part = part_ptr + tl.program_id(2) * stride_ps + rows[None, :] * (2 * INTER) + i[:, None]
                tl.store(part, gate, mask=valid[None, :])
                tl.store(part + INTER, up, mask=valid[None, :])
            else:
                _swiglu_store(gate, up, pair, rows, valid, weights_ptr, h_ptr, stride_hm, i, limit, CLAMP, H_BLOCK_K)
        if SPLITS > 1:
            last = arrives_last(counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLITS)
            if last:
                for m0 in range(start, end, BLOCK_M):
                    rows = m0 + tl.arange(0, BLOCK_M)
                    valid = rows < end
                    pair = tl.load(pair_ptr + rows, mask=valid, other=0)
                    part = part_ptr + rows[None, :] * (2 * INTER) + i[:, None]
                    gate = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
                    up = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
                    for s in tl.static_range(SPLITS):
                        gate += tl.load(part + s * stride_ps, mask=valid[None, :], other=0.0, cache_modifier=".cg")
                        up += tl.load(part + s * stride_ps + INTER, mask=valid[None, :], other=0.0,
                                      cache_modifier=".cg")  # fmt: skip
                    _swiglu_store(
                        gate, up, pair, rows, valid, weights_ptr, h_ptr, stride_hm, i, limit, CLAMP, H_BLOCK_K
                    )


@triton.jit
def _fp4_down_kernel(
    h_ptr, w2_ptr, s2_ptr, g2_ptr, pair_ptr, active_ptr, offsets_ptr, y_ptr, part_ptr, counter_ptr,
    stride_hm, stride_we, stride_wd, stride_se, stride_sd, stride_ym, stride_ps,
    E: tl.constexpr, D: tl.constexpr, INTER: tl.constexpr, G: tl.constexpr, NV: tl.constexpr, SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, BF16X2: tl.constexpr,
):  # fmt: skip
    """moe._down_kernel over packed weights: one expert's rows [tile * BLOCK_D, +BLOCK_D) of w2 against all of that
    expert's pairs over K split `program_id(2)` of SPLITS (partials in part [SPLITS, pairs, D], added by the tile's
    last program)."""
    e = tl.load(active_ptr + tl.program_id(0))
    if e < E:
        start = tl.load(offsets_ptr + e)
        end = tl.load(offsets_ptr + e + 1)
        g2 = tl.load(g2_ptr + e) if NV else 1.0
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        w_offs, s_offs = _fp4_tile_offsets(e, d, stride_we, stride_wd, stride_se, stride_sd, BLOCK_K, G)
        quarter = tl.arange(0, BLOCK_K // 4)
        dtype = y_ptr.dtype.element_ty
        k_start = tl.program_id(2) * (INTER // SPLITS)
        k_last = k_start + INTER // SPLITS - BLOCK_K
        for m0 in range(start, end, BLOCK_M):
            rows = m0 + tl.arange(0, BLOCK_M)
            valid = rows < end
            pair = tl.load(pair_ptr + rows, mask=valid, other=0)
            h_ptrs = h_ptr + rows[None, :] * stride_hm + quarter[:, None]  # h phase-major, as gate/up wrote it
            acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
            sc2 = tl.load(s2_ptr + s_offs + k_start // G)
            for k0 in range(k_start, k_last + BLOCK_K, BLOCK_K):  # the scales a step ahead, as in gate/up
                k1 = tl.minimum(k0 + BLOCK_K, k_last)
                sc2_next = tl.load(s2_ptr + s_offs + k1 // G)
                h0, h1, h2, h3 = _load_phases(h_ptrs, k0, valid[None, :], BLOCK_K)
                w0, w1, w2, w3 = _upcast(tl.load(w2_ptr + w_offs + k0 // 4), sc2, g2, NV, dtype, BF16X2)
                acc = _dot_phases(w0, w1, w2, w3, h0, h1, h2, h3, acc, F32_DOT)
                sc2 = sc2_next
            if SPLITS > 1:
                tl.store(part_ptr + tl.program_id(2) * stride_ps + pair[None, :] * D + d[:, None], acc,
                         mask=valid[None, :])  # fmt: skip
            else:
                tl.store(y_ptr + pair[None, :] * stride_ym + d[:, None], acc.to(dtype), mask=valid[None, :])
        if SPLITS > 1:
            last = arrives_last(counter_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), SPLITS)
            if last:
                for m0 in range(start, end, BLOCK_M):
                    rows = m0 + tl.arange(0, BLOCK_M)
                    valid = rows < end
                    pair = tl.load(pair_ptr + rows, mask=valid, other=0)
                    acc = tl.zeros([BLOCK_D, BLOCK_M], dtype=tl.float32)
                    for s in tl.static_range(SPLITS):
                        acc += tl.load(part_ptr + s * stride_ps + pair[None, :] * D + d[:, None], mask=valid[None, :],
                                       other=0.0, cache_modifier=".cg")  # fmt: skip
                    tl.store(y_ptr + pair[None, :] * stride_ym + d[:, None], acc.to(dtype), mask=valid[None, :])


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def phase_major(x: torch.Tensor, block_k: int) -> torch.Tensor:
    """x [N, K] with each tile of block_k values rearranged phase-major (the values at K = 4j + p for phase p = 0..3
    in turn), as the kernels read activations: one copy."""
    n, k = x.shape
    return x.reshape(n, k // block_k, block_k // 4, 4).transpose(2, 3).contiguous().view(n, k)


def _words(codes: torch.Tensor) -> torch.Tensor:
    """Packed codes [E, R, C/2] as 16-bit words [E, R, C/4], four codes a word (the kernels' unit)."""
    try:
        return codes.view(torch.int16)
    except RuntimeError as error:
        raise ValueError(f"FP4 codes {tuple(codes.shape)} with strides {codes.stride()} do not read as 16-bit words "
                         "(rows of an even number of bytes, K contiguous)") from error  # fmt: skip


def expert_splits(programs: int, k_steps: int, device: torch.device) -> int:
    """Splits of K for an expert kernel of `programs` (expert slots x tiles): where they leave the GPU short of
    PROGRAMS_PER_SM a multiprocessor (decode at a few tokens: 6 experts x 32 tiles of w1/w3 on 132 SMs), the largest
    power of two that keeps programs x splits within that and divides the K steps. It depends on the shapes alone, so
    a captured graph keeps its grid."""
    room = PROGRAMS_PER_SM * multiprocessors(device) // max(programs, 1)
    splits = 1
    while 2 * splits <= room and k_steps % (2 * splits) == 0:
        splits *= 2
    return splits


def expert_tiles(tokens: int, pairs: int, n_experts: int, device: torch.device) -> dict[str, int]:
    """The expert kernels' tiles and warps for `pairs` (token, expert) pairs of `tokens` tokens over `n_experts`:
    LARGE_TILES beyond 64 pairs an expert on average where a block may use 200 KB of shared memory, else 64-row
    weight tiles in 4 warps against pair tiles of half the tokens' power of two, from 16 to 64. Shapes alone decide,
    so a captured graph keeps its launches."""
    if pairs > 64 * n_experts and device.type == "cuda" and shared_memory_limit(device) >= 200 * 1024:
        return LARGE_TILES
    return {"block_m": min(64, max(16, triton.next_power_of_2(tokens) // 2)), "block_i": 64, "block_d": 64,
            "num_warps": 4}  # fmt: skip


def moe_expert_pairs_fp4_triton(
    x, weights, ids, w1: PackedFp4, w3: PackedFp4, w2: PackedFp4, limit, touched=None, remote=False,
    block_m: int | None = None, block_i: int | None = None, block_d: int | None = None, block_k: int = 128,
    num_warps: int | None = None, num_stages: int = 3, bf16x2: bool = True, splits_up: int | None = None,
    splits_down: int | None = None,
):  # fmt: skip
    """Three launches, as moe.moe_expert_pairs_triton: the counting sort (which counts the experts touched), then
    gate/up and down over the active experts, each splitting K by expert_splits unless given. Tiles and warps not
    given are expert_tiles'. block_k counts values (two a byte), a multiple of 32. bf16x2=False takes the e4m3 route
    for MXFP4 into bf16 too (bench/quant.py compares the two)."""
    n, dim = x.shape
    n_experts, inter, _ = w1.codes.shape
    top_k, group, nv = ids.shape[1], w1.block, w1.global_scale is not None
    pairs = n * top_k
    if pairs == 0:
        return torch.zeros(pairs, dim, dtype=x.dtype, device=x.device)
    tiles = expert_tiles(n, pairs, n_experts, x.device)
    block_m, block_i, block_d = block_m or tiles["block_m"], block_i or tiles["block_i"], block_d or tiles["block_d"]
    num_warps = num_warps or tiles["num_warps"]
    block_i, block_d = min(block_i, inter), min(block_d, dim)
    block_k_up, block_k_down = min(block_k, dim), min(block_k, inter)
    c1, c3, c2 = _words(w1.codes), _words(w3.codes), _words(w2.codes)
    s1, s3, s2 = _bytes(w1.scale), _bytes(w3.scale), _bytes(w2.scale)
    if (inter % block_i or dim % block_d or dim % block_k_up or inter % block_k_down or block_k_up % MX_BLOCK
            or block_k_down % MX_BLOCK or c1.stride() != c3.stride() or s1.stride() != s3.stride()
            or tuple(c2.shape) != (n_experts, dim, inter // 4) or c1.stride(2) != 1 or c2.stride(2) != 1
            or s1.stride(2) != 1 or s2.stride(2) != 1 or s1.shape[2] * group != dim
            or any((w.global_scale is not None) != nv for w in (w3, w2))):  # fmt: skip
        raise ValueError(f"FP4 experts D={dim}, I={inter} do not tile by {block_i}, {block_d}, {block_k}, or their "
                         "codes / scales are not laid out alike with K contiguous")  # fmt: skip
    # MXFP4 has no global scales: the scale tensors stand in for the pointers the kernels then never read
    g1, g3, g2 = (w.global_scale if nv else s for w, s in ((w1, s1), (w3, s3), (w2, s2)))
    order, offsets, active, y = sort_pairs(ids, n_experts, touched, remote, dim, x)
    x = phase_major(x, block_k_up)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # x's dtype before w2, as the reference
    f32_dot = x.dtype == torch.float32 or interpreting()
    bf16x2 = bf16x2 and x.dtype == torch.bfloat16 and not nv and not interpreting()
    grid_up, grid_down = (len(active), inter // block_i), (len(active), dim // block_d)
    splits_up = splits_up or expert_splits(grid_up[0] * grid_up[1], dim // block_k_up, x.device)
    splits_down = splits_down or expert_splits(grid_down[0] * grid_down[1], inter // block_k_down, x.device)
    if dim % (splits_up * block_k_up) or inter % (splits_down * block_k_down):
        raise ValueError(f"K splits {splits_up} / {splits_down} do not divide D={dim} / I={inter} in steps of "
                         f"{block_k_up} / {block_k_down}")  # fmt: skip
    # fp32 partials of split launches (x stands in where unread), one counter a tile
    part_up = x if splits_up == 1 else torch.empty(splits_up, pairs, 2 * inter, dtype=torch.float32, device=x.device)
    part_down = x if splits_down == 1 else torch.empty(splits_down, pairs, dim, dtype=torch.float32, device=x.device)
    split = max(splits_up, splits_down) > 1
    counters = tile_counters(x.device, max(grid_up[0] * grid_up[1], grid_down[0] * grid_down[1])) if split else x
    _fp4_gate_up_kernel[(*grid_up, splits_up)](
        x, c1, s1, g1, c3, s3, g3, order, weights.reshape(-1), active, offsets, h, part_up, counters,
        x.stride(0), c1.stride(0), c1.stride(1), s1.stride(0), s1.stride(1), h.stride(0),
        part_up.stride(0) if splits_up > 1 else 0, limit,
        E=n_experts, TOP_K=top_k, D=dim, INTER=inter, CLAMP=limit > 0, G=group, NV=nv, SPLITS=splits_up,
        BLOCK_M=block_m, BLOCK_I=block_i, BLOCK_K=block_k_up, H_BLOCK_K=block_k_down, F32_DOT=f32_dot, BF16X2=bf16x2,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _fp4_down_kernel[(*grid_down, splits_down)](
        h, c2, s2, g2, order, active, offsets, y, part_down, counters,
        h.stride(0), c2.stride(0), c2.stride(1), s2.stride(0), s2.stride(1), y.stride(0),
        part_down.stride(0) if splits_down > 1 else 0,
        E=n_experts, D=dim, INTER=inter, G=group, NV=nv, SPLITS=splits_down,
        BLOCK_M=block_m, BLOCK_D=block_d, BLOCK_K=block_k_down, F32_DOT=f32_dot, BF16X2=bf16x2,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return y


def moe_expert_pairs_fp4(x, weights, ids, w1: PackedFp4, w3: PackedFp4, w2: PackedFp4, limit, touched=None,
                         remote=False):  # fmt: skip
    """The Triton kernels on CUDA, the reference elsewhere."""
    impl = moe_expert_pairs_fp4_triton if use_triton(x.device) else moe_expert_pairs_fp4_reference
    return impl(x, weights, ids, w1, w3, w2, limit, touched, remote)
