"""The int4 direct MoE GEMM's GEMV mainloop: one token (batch-1 decode), so each expert program multiplies one
activation row, with no 16-row MMA tile.

Why: on the H200 (2026-12-04, benchmarks/moe_tile_sweep.py) the int4 direct GEMMs at one token streamed ~1 TB/s of
int4 weight whatever their tile, a quarter of the copy bandwidth: each K step dequantizes a [BLOCK_N, BLOCK_K]
tile, rounds it to the activation dtype, moves it through shared memory into the MMA operand layout and multiplies
15 rows of zeros with it. Here the tile stays in registers and is reduced against the row with FMAs.

Arithmetic per K tile (BLOCK_K divides the group, so one zero point and scale per output row, as in
quant/tiles.py int4_tile): the nibbles are OR-ed into the mantissa of 2^23 (exact 2^23 + q, no int -> float
conversion), (2^23 + q) - (2^23 + z) = q - z exactly, times the row's activations summed in fp32, then times the
group's scale once. So the weight is not rounded to the activation dtype before the product, as the MMA path and
the native oracle do (they densify to that dtype): in bf16 the result differs from theirs by that rounding
(relative ~2^-9 per weight, averaging out over K); in fp32 (the interpreter tests) only by summation order.

Not measured on a GPU yet: off by default (DEEPINFER_MOE_INT4_GEMV, or cfg["gemv"] in tile sweeps).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _int4_gemv_step(b_base, s_base, z_base, brows, nmask, k0, x, stride_bn, stride_qn, stride_qk,
                    GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """sum_k (q[n, k] - z[n]) * x[k] * s[n] over the K tile at k0 (x: its BLOCK_K activations, fp32): [BLOCK_N]."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_b = k0 // 2 + tl.arange(0, HALF)
    byte = tl.load(b_base + brows[:, None] * stride_bn + offs_b[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    q = tl.interleave(byte & 0xF, byte >> 4)  # channel 2b = low nibble, 2b + 1 = high (int4_tile's order)
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
    off = brows * stride_qn + (k0 // GROUP) * stride_qk
    z = tl.load(z_base + off, mask=nmask, other=0).to(tl.float32)
    s = tl.load(s_base + off, mask=nmask, other=0.0).to(tl.float32)
    return tl.sum((qf - (z + 8388608.0)[:, None]) * x[None, :], axis=1) * s


@triton.jit
def int4_gemv(a_ptr, row, stride_am, b_base, u_off, offs_n, nmask, stride_bn, K, s_base, z_base, uq_off,
              stride_qn, stride_qk, DUAL: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """(acc_g, acc_u) [BLOCK_N] fp32: activation row `row` times the int4 weight rows offs_n (and, DUAL, the up
    rows u_off bytes / uq_off scale entries further). K is a multiple of BLOCK_K (the callers' int4 tiles)."""
    brows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_row = a_ptr + row * stride_am
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(a_row + k0 + offs_k).to(tl.float32)
        acc_g += _int4_gemv_step(b_base, s_base, z_base, brows, nmask, k0, x, stride_bn, stride_qn, stride_qk,
                                 GROUP, BLOCK_K)
        if DUAL:
            acc_u += _int4_gemv_step(b_base + u_off, s_base + uq_off, z_base + uq_off, brows, nmask, k0, x,
                                     stride_bn, stride_qn, stride_qk, GROUP, BLOCK_K)
    return acc_g, acc_u

