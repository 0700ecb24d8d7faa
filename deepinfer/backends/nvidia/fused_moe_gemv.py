"""The int4 direct MoE GEMM's GEMV mainloop: one token (batch-1 decode), so each expert program multiplies one
activation row, with no 16-row MMA tile.

Why: on the H200 (2026-12-04, benchmarks/moe_tile_sweep.py) the int4 direct GEMMs at one token streamed ~1 TB/s of
int4 weight whatever their tile, a quarter of the copy bandwidth: each K step dequantizes a [BLOCK_N, BLOCK_K]
tile, rounds it to the activation dtype, moves it through shared memory into the MMA operand layout and multiplies
15 rows of zeros with it. Here the tile stays in registers and is reduced against the row with FMAs.

Arithmetic per K tile: quant/tiles.py int4_row_dot (q - z exact in fp32, times the row's activations summed in
fp32, times the group's scale once). The weight is not rounded to the activation dtype before the product, as the
MMA path and the native oracle do (they densify to that dtype): in bf16 the result differs from theirs by that
rounding (relative ~2^-9 per weight, averaging out over K); in fp32 (the interpreter tests) only by summation order.

Not measured on a GPU yet: off by default (DEEPINFER_INT4_GEMV, or cfg["gemv"] in tile sweeps).
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.nvidia.quant.tiles import int4_row_dot


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
        acc_g += int4_row_dot(b_base, s_base, z_base, brows, nmask, k0, x, stride_bn, stride_qn, stride_qk,
                              GROUP, BLOCK_K)
        if DUAL:
            acc_u += int4_row_dot(b_base + u_off, s_base + uq_off, z_base + uq_off, brows, nmask, k0, x,
                                  stride_bn, stride_qn, stride_qk, GROUP, BLOCK_K)
    return acc_g, acc_u

