"""Triton tile helpers shared by the quantized dense GEMMs (quant/) and the grouped MoE GEMMs (fused_moe_gemm.py).

- `fp8_quant_rows`: a [ROWS, 128] tile of activations -> e4m3 values and one fp32 scale per row, the
  arithmetic of fp8_act_quant.py (and of the torch reference quantize_act_fp8): amax over the row's 128
  channels (masked channels load as 0), scale = max(amax, 1e-10) / 448, q = e4m3(clamp(x / scale)). A GEMM
  that quantizes its A tile as it loads it gets the same values and scales as the separate kernel, so the
  two paths give the same product; it saves a launch and the fp8 copy's round trip where the tile is
  re-quantized few times (decode-sized M: one program per 32-128 output columns re-reads A anyway).
- `int4_row_dot`: the same weight tile reduced against one token's activations (a GEMV step, no MMA), with the
  scale applied once per tile; the int4 GEMV mainloops' step (int4_gemm.py, fused_moe_gemv.py).
- `int4_tile`: a [BLOCK_N, BLOCK_K] tile of an int4 weight in the row layout shared by the dense linears
  and the routed experts (uint8 [N, K/2], two per byte, low nibble = even input channel; fp16 / fp32 scales
  and uint8 zero points [N, K/G]), dequantized in registers as (q - z) * s in fp32 and rounded once to the
  activation dtype (the reference's values, bit for bit). Why it is shaped this way (the old kernels spent
  their time in the load/store unit, not on DRAM):
  * the bytes are loaded once, as a [BLOCK_N, BLOCK_K/2] tile contiguous along K (16-byte vector loads),
    and split into nibbles with `tl.interleave` (the old code loaded every byte twice, the dense one every
    4-byte word eight times);
  * with contiguous groups (AWQ, GPTQ without act-order) BLOCK_K divides G, so a K tile has one zero and
    one scale per row: two [BLOCK_N] loads per tile instead of two [BLOCK_K, BLOCK_N] gathers. An
    act-order GPTQ weight (GIDX) gathers them per input channel through g_idx, as before;
  * q - z is formed without an int -> float conversion (a quarter-rate instruction on Hopper): the nibble
    is OR-ed into the mantissa of 2^23 and 2^23 + z is subtracted, exact for integers below 2^24, then one
    multiply by the scale. Same value as float(q) - z.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the compute dtypes a kernel's ACT constexpr takes, by torch dtype (the MoE GEMMs, the SiLU-and-mul quant)
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def fp8_quant_rows(x, ROUND_FIRST: tl.constexpr):
    """x: fp32 [R, C] (C = one 128-channel group, masked channels 0) -> (e4m3 [R, C], fp32 scale [R]).

    ROUND_FIRST (the interpreter only): its fp32 -> float8e4nv cast drops the carry across a power of two
    (fp8_act_quant.py), so the value is rounded to 3 mantissa bits first; the GPU's conversion rounds right."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    scale = amax / 448.0
    q = tl.clamp(x / scale[:, None], -448.0, 448.0)
    if ROUND_FIRST:
        bits = q.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
        # below e4m3's smallest normal (2^-6) its step is 2^-9: round there instead (adding and subtracting
        # 1.5 * 2^14, whose fp32 step is 2^-9, rounds half to even); the mantissa rounding above is too fine there
        q = tl.where(tl.abs(q) < 0.015625, (q + 24576.0) - 24576.0, bits.to(tl.float32, bitcast=True))
    return q.to(tl.float8e4nv), scale


@triton.jit
def int4_tile(w_base, s_base, z_base, g_ptr, offs_n, nmask, k0, stride_wn, stride_sn, stride_sk,
              GIDX: tl.constexpr, GROUP: tl.constexpr, BLOCK_K: tl.constexpr, ACT: tl.constexpr):
    """Rows offs_n, input channels [k0, k0 + BLOCK_K) of an int4 weight, dequantized: [BLOCK_N, BLOCK_K] in ACT
    (a GEMM takes tl.trans of it as its B operand).

    w_base: uint8 [N, K/2] (row stride stride_wn bytes); s_base / z_base: scales / zero points [N, K/G]
    (strides stride_sn, stride_sk, the same for both). GIDX: g_ptr holds each input channel's group (int32 [K],
    act-order); else BLOCK_K divides GROUP and k0 is a multiple of BLOCK_K (the tile lies in one group).
    K is a multiple of BLOCK_K (the callers pick BLOCK_K <= G, and G divides K): no mask along K."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_b = k0 // 2 + tl.arange(0, HALF)
    m = nmask[:, None]
    byte = tl.load(w_base + offs_n[:, None].to(tl.int64) * stride_wn + offs_b[None, :], mask=m, other=0)
    byte = byte.to(tl.int32)
    q = tl.interleave(byte & 0xF, byte >> 4)  # [BLOCK_N, BLOCK_K]: channel 2b = low nibble, 2b + 1 = high
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
    if GIDX:
        grp = tl.load(g_ptr + k0 + tl.arange(0, BLOCK_K))
        off = offs_n[:, None].to(tl.int64) * stride_sn + grp[None, :] * stride_sk
        z = tl.load(z_base + off, mask=m, other=0).to(tl.float32)
        s = tl.load(s_base + off, mask=m, other=0.0).to(tl.float32)
        w = (qf - (z + 8388608.0)) * s
    else:
        off = offs_n.to(tl.int64) * stride_sn + (k0 // GROUP) * stride_sk
        z = tl.load(z_base + off, mask=nmask, other=0).to(tl.float32)
        s = tl.load(s_base + off, mask=nmask, other=0.0).to(tl.float32)
        w = (qf - (z + 8388608.0)[:, None]) * s[:, None]
    return w.to(ACT)


@triton.jit
def int4_row_dot(w_base, s_base, z_base, rows, nmask, k0, x, stride_wn, stride_sn, stride_sk,
                 GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32: sum over the K tile at k0 of W[rows, k] * x[k] (x: the tile's BLOCK_K activations of one
    token, fp32), for a GEMV (one token: no MMA tile). The int4_tile layout and nibble order; BLOCK_K divides GROUP
    (one zero point and scale per row and tile): (2^23 + q) - (2^23 + z) = q - z exactly, times x summed in fp32,
    then times the scale once. The weight is not rounded to the activation dtype first (int4_tile's callers round
    it: their MMA takes that dtype), so in bf16 the product differs from theirs by that rounding."""
    HALF: tl.constexpr = BLOCK_K // 2
    offs_b = k0 // 2 + tl.arange(0, HALF)
    byte = tl.load(w_base + rows[:, None] * stride_wn + offs_b[None, :], mask=nmask[:, None], other=0).to(tl.int32)
    q = tl.interleave(byte & 0xF, byte >> 4)
    qf = (q | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q, exactly
    off = rows * stride_sn + (k0 // GROUP) * stride_sk
    z = tl.load(z_base + off, mask=nmask, other=0).to(tl.float32)
    s = tl.load(s_base + off, mask=nmask, other=0.0).to(tl.float32)
    return tl.sum((qf - (z + 8388608.0)[:, None]) * x[None, :], axis=1) * s
