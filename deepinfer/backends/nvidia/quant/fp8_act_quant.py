"""Per-token, per-128-channel fp8 e4m3 activation quantization (the A side of the W8A8 GEMM).

One program per (16 rows, group): per row the amax over the group's channels (a partial last group is masked),
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

from deepinfer.backend import Fp8Act, empty_fp8_act
from deepinfer.backends.nvidia.quant.tiles import TL_DTYPES, fp8_quant_rows
from deepinfer.errors import BackendError

GROUP = 128


@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_x, stride_q, stride_sm, stride_sg,
                      ROUND_FIRST: tl.constexpr, ROWS: tl.constexpr, GROUP: tl.constexpr):
    """Program (r, g): rows [r * ROWS, (r + 1) * ROWS), channel group g (one scale per row). Rows M..M_OUT are
    padding: x reads as 0 there, so they store q = 0 (and the floor scale)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, GROUP)
    kmask = (offs < K)[None, :]
    omask = rows < M_OUT
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_x + offs[None, :], mask=(rows < M)[:, None] & kmask, other=0.0).to(tl.float32)
    q, scale = fp8_quant_rows(x, ROUND_FIRST)
    tl.store(q_ptr + r64 * stride_q + offs[None, :], q, mask=omask[:, None] & kmask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_sm + grp * stride_sg, scale, mask=omask)


def quantize_act_fp8(x: torch.Tensor, scales_col_major: bool = False,
                     pad_rows_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (row-contiguous) -> (e4m3 [M', K], fp32 scales [M', ceil(K/128)]), M' = M rounded up to a multiple
    of pad_rows_to (the extra rows are zeros). scales_col_major: the scales are a transposed view (strides (1, M')),
    the layout cuBLAS's block-scaled fp8 GEMM reads (quant/fp8_cublas.py, which also pads M)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    g = triton.cdiv(k, GROUP)
    mp = triton.cdiv(m, pad_rows_to) * pad_rows_to
    q = torch.empty((mp, k), dtype=torch.float8_e4m3fn, device=x.device)
    if scales_col_major:
        s = torch.empty((g, mp), dtype=torch.float32, device=x.device).t()
    else:
        s = torch.empty((mp, g), dtype=torch.float32, device=x.device)
    if m:
        on_gpu = x.device.type == "cuda"
        rows = 16 if on_gpu else 4  # 16 rows x 128 channels: 4 warps, one 16-byte load per thread and row
        _act_quant_kernel[(triton.cdiv(mp, rows), g)](x, q, s, m, mp, k, x.stride(0), q.stride(0), s.stride(0),
                                                      s.stride(1), ROUND_FIRST=not on_gpu, ROWS=rows, GROUP=GROUP,
                                                      num_warps=4)
    return q, s


@triton.jit
def _silu_mul_quant_kernel(x_ptr, q_ptr, s_ptr, scm_ptr, y_ptr, M, M_OUT, I, stride_x, stride_q, stride_s,
                           stride_cm, stride_y, ACT: tl.constexpr, ROUND_FIRST: tl.constexpr, ROWS: tl.constexpr,
                           GROUP: tl.constexpr, WRITE_CM: tl.constexpr, WRITE_Y: tl.constexpr):
    """Program (r, g): rows [r * ROWS, (r + 1) * ROWS) of x [M, 2I] (gate | up, the activation dtype), channel
    group g of the output: silu(gate) rounded to ACT, times up, rounded to ACT (the values the fused dual gate_up
    epilogue quantizes, fused_moe_mainloop._epilogue / _store_fp8_rows, and activation.py's silu_and_mul writes),
    then e4m3 per row over the group. Rows M..M_OUT are padding (zeros: q 0, the floor scale). WRITE_CM: the scales
    also column-major to scm_ptr (backend/fp8_act.py); WRITE_Y: the rounded values too, to y_ptr."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    grp = tl.program_id(1)
    offs = grp * GROUP + tl.arange(0, GROUP)
    mask = (rows < M)[:, None] & (offs < I)[None, :]
    omask = (rows < M_OUT)[:, None] & (offs < I)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    g = tl.load(x_ptr + r64 * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + r64 * stride_x + I + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(ACT).to(tl.float32)
    y = tl.where(mask, (act * u).to(ACT).to(tl.float32), 0.0)
    if WRITE_Y:
        tl.store(y_ptr + r64 * stride_y + offs[None, :], y.to(ACT), mask=mask)
    q, scale = fp8_quant_rows(y, ROUND_FIRST)
    tl.store(q_ptr + r64 * stride_q + offs[None, :], q, mask=omask)
    tl.store(s_ptr + rows.to(tl.int64) * stride_s + grp, scale, mask=rows < M_OUT)
    if WRITE_CM:
        tl.store(scm_ptr + grp * stride_cm + rows.to(tl.int64), scale, mask=rows < M_OUT)


def silu_mul_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, 2I] (gate | up, row-contiguous, the compute dtype) -> (e4m3 [M, I], fp32 scales [M, ceil(I/128)]):
    silu(gate) * up with the native op's roundings, quantized per row per 128 channels. The W8A8 MoE's split
    gate_up (fused_moe.py) writes x; the down GEMM reads the result as the fused gate_up's e4m3 output."""
    m, two_i = x.shape
    if two_i % 2 or x.stride(1) != 1 or x.dtype not in TL_DTYPES:
        raise BackendError(f"silu_mul_quant_fp8: x must be [M, 2I], row-contiguous, 16/32-bit float; got "
                           f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    inter = two_i // 2
    g = triton.cdiv(inter, GROUP)
    q = torch.empty((m, inter), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((m, g), dtype=torch.float32, device=x.device)
    if m:
        on_gpu = x.device.type == "cuda"
        rows = 16 if on_gpu else 4
        _silu_mul_quant_kernel[(triton.cdiv(m, rows), g)](x, q, s, s, q, m, m, inter, x.stride(0), q.stride(0),
                                                          s.stride(0), 0, 0, ACT=TL_DTYPES[x.dtype],
                                                          ROUND_FIRST=not on_gpu, ROWS=rows, GROUP=GROUP,
                                                          WRITE_CM=False, WRITE_Y=False, num_warps=4)
    return q, s


def silu_mul_fp8_act(x: torch.Tensor, keep_values: bool = False) -> Fp8Act:
    """`Backend.silu_and_mul_fp8`: x [M, 2I] (gate | up) -> Fp8Act of silu(gate) * up (the values silu_and_mul
    writes, quantized per row per 128 channels; rows padded, both scale layouts), one launch. keep_values: also the
    compute-dtype values (Fp8Act.x), for a consumer that reads them."""
    m, two_i = x.shape
    if two_i % 2 or x.stride(1) != 1 or x.dtype not in TL_DTYPES:
        raise BackendError(f"silu_mul_fp8_act: x must be [M, 2I], row-contiguous, 16/32-bit float; got "
                           f"{tuple(x.shape)} {x.dtype} strides {x.stride()}")
    inter = two_i // 2
    y = torch.empty((m, inter), dtype=x.dtype, device=x.device) if keep_values else None
    act = empty_fp8_act(m, inter, x.device, y)
    mp = act.q.shape[0]
    if m:
        on_gpu = x.device.type == "cuda"
        rows = 16 if on_gpu else 4
        _silu_mul_quant_kernel[(triton.cdiv(mp, rows), triton.cdiv(inter, GROUP))](
            x, act.q, act.s, act.s_cm, y if y is not None else act.q, m, mp, inter, x.stride(0), act.q.stride(0),
            act.s.stride(0), act.s_cm.stride(1), y.stride(0) if y is not None else 0, ACT=TL_DTYPES[x.dtype],
            ROUND_FIRST=not on_gpu, ROWS=rows, GROUP=GROUP, WRITE_CM=True, WRITE_Y=y is not None, num_warps=4)
    return act
