"""fp8 (e4m3) KV-cache values in Triton: what the MLA write kernels store (kv_write, mla_prep).

`fp8_e4m3_value(x, scale)` is x / scale (IEEE division), clamped to ±448 and rounded to nearest even to
e4m3's grid (3 mantissa bits; steps of 2^-9 below 2^-6, the subnormals), returned as the fp32 value
that the cast to float8e4nv then stores exactly. The rounding is done here rather than left to the
cast because Triton's interpreter (TRITON_INTERPRET=1, 3.9) rounds fp32 -> float8e4nv wrongly when the
mantissa carries into the exponent (31.7 -> 16 instead of 32; checked 2026-12), and the interpreter
is where these kernels are tested against the torch reference (deepinfer.backend.kv_spec.quantize_kv);
on the GPU the cast of an exactly representable value is exact either way. A few integer ops per stored
value in the write; the read side is a plain cast (every e4m3 value is a bf16 / fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

FP8_E4M3_MAX = tl.constexpr(448.0)
# 1.5 * 2^14: adding it (in fp32) rounds |x| < 2^-6 to a multiple of 2^-9, e4m3's subnormal step
_SUBNORMAL_MAGIC = tl.constexpr(24576.0)


@triton.jit
def fp8_e4m3_value(x, scale, SCALED: tl.constexpr):
    """x (fp32) as the fp32 value an e4m3 cache with this scale stores (see the module docstring)."""
    if SCALED:
        x = tl.math.div_rn(x, scale)
    x = tl.minimum(tl.maximum(x, -FP8_E4M3_MAX), FP8_E4M3_MAX)
    u = x.to(tl.uint32, bitcast=True)
    # normal range: round the fp32 mantissa to its top 3 bits, ties to even (a carry moves to the next binade)
    normal = ((u + 0x7FFFF + ((u >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = (x + _SUBNORMAL_MAGIC) - _SUBNORMAL_MAGIC
    sub = (sub.to(tl.uint32, bitcast=True) | (u & 0x80000000)).to(tl.float32, bitcast=True)  # keep -0
    return tl.where(tl.abs(x) < 0.015625, sub, normal)
