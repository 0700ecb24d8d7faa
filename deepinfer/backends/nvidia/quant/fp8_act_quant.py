"""Per-token, per-128-channel fp8 e4m3 activation quantization (the A side of the W8A8 GEMM).

One program per (row, group): amax over the group's channels (a partial last group is masked),
scale = max(amax, 1e-10) / 448, q = e4m3(clamp(x / scale)). The same arithmetic as the torch
reference (deepinfer.backend native quant_fp8.quantize_act_fp8), so the two agree bit for bit.

ROUND_FIRST (the interpreter only): its fp32 -> float8e4nv cast drops the carry when a value rounds up
across a power of two (124.3 -> 64 instead of 128; checked with Triton 3.6 on torch 2.13 CPU, NOTES in
docs/quantization.md), so the value is first rounded to 3 mantissa bits (round half to even on the fp32
bits) and the cast then only converts an exact value. The GPU's conversion instruction rounds right.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0
GROUP = 128


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, G,
                      FP8_MAX: tl.constexpr, FLOOR: tl.constexpr, GROUP: tl.constexpr, ROUND_FIRST: tl.constexpr):
    row = tl.program_id(0)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, GROUP)
    mask = offs < K
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=0), FLOOR)
    scale = amax / FP8_MAX
    q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    if ROUND_FIRST:
        bits = q.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000  # keep 3 mantissa bits, half to even
        q = bits.to(tl.float32, bitcast=True)
    tl.store(q_ptr + row * stride_q + offs, q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + row * G + grp, scale)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-contiguous) -> (e4m3 [M, K], fp32 scales [M, ceil(K/128)])."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    g = triton.cdiv(k, GROUP)
    q = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m:
        _act_quant_kernel[(m, g)](x, q, s, k, x.stride(0), q.stride(0), g, FP8_MAX=FP8_MAX, FLOOR=1e-10,
                                  GROUP=GROUP, ROUND_FIRST=x.device.type != "cuda", num_warps=1)
    return q, s
