"""RMSNorm (with the residual add) that also writes its output's fp8 e4m3 quantization: `Backend.rms_norm_fp8`.

One program per row, as rmsnorm.py: the same arithmetic for the sum and the normed row (fp32 statistic, rounded to
the input dtype, times the weight, rounded to the output dtype), then the rounded output per 128-channel group
through quant/tiles.fp8_quant_rows (the act-quant kernel's arithmetic): e4m3 values and one fp32 scale per group,
stored row-major and column-major (backend/fp8_act.py says why both). Rows T..Tp of the padded quantization read
zeros: q 0 and the floor scale, as fp8_act_quant.py writes its padding.

Why: under fp8 W8A8 the norm's output was written, read back by a separate act-quant kernel per consumer (the MoE
input twice: the shared experts' GEMM and the routed experts'), and quantized there; here the row is quantized
while it is in registers: one launch a norm instead of two or three.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backend import Fp8Act, empty_fp8_act
from deepinfer.backends.nvidia.quant.tiles import fp8_quant_rows
from deepinfer.backends.nvidia.rmsnorm import rms_norm_row
from deepinfer.errors import BackendError

GROUP = 128


@triton.jit
def _rms_norm_fp8_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, q_ptr, s_ptr, scm_ptr,
    M, D, stride_x, stride_r, stride_o, stride_s, stride_q, stride_sm, stride_cm, eps,
    HAS_RES: tl.constexpr, ROUND_FIRST: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
):
    row = tl.program_id(0)
    r64 = row.to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    cmask = offs < D
    mask = offs < tl.where(row < M, D, 0)  # rows M.. are the quantization's padding: nothing read or written
    out = rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, r64, offs, mask, cmask, D, stride_x, stride_r, stride_s, eps,
                       HAS_RES).to(out_ptr.dtype.element_ty)  # rmsnorm.py's arithmetic (the same bits)
    tl.store(out_ptr + r64 * stride_o + offs, out, mask=mask)
    # the rounded output per 128-channel group (masked channels and padding rows are 0, as the act quant reads them),
    # read back as a [groups, GROUP] tile: the row this program just stored (the barrier makes every thread's stores
    # visible to the others), from the L2. Not a tl.reshape of the registers: Triton 3.6 (the H100 / H200 image's)
    # compiled that reshape into a byte-wise trip through shared memory and byte-wise e4m3 stores, and the kernel ran
    # 4.5x the plain norm's time at 16,384 rows on an H100 (386 against 86 us a launch, 2026-12-06)
    tl.debug_barrier()
    groups: tl.constexpr = BLOCK_D // GROUP
    g = tl.arange(0, groups)
    qoffs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    vals = tl.load(out_ptr + r64 * stride_o + qoffs, mask=qoffs < tl.where(row < M, D, 0), other=0.0,
                   cache_modifier=".cg").to(tl.float32)  # (.cg: from the L2, where the stores went; no L1 line)
    q, scale = fp8_quant_rows(vals, ROUND_FIRST)
    tl.store(q_ptr + r64 * stride_q + qoffs, q, mask=qoffs < D)
    gmask = g * GROUP < D
    tl.store(s_ptr + r64 * stride_sm + g, scale, mask=gmask)
    tl.store(scm_ptr + g * stride_cm + r64, scale, mask=gmask)


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[Fp8Act, torch.Tensor | None]:
    """(Fp8Act of rms_norm(x + residual), x + residual or None), one launch; x / residual [T, D] row-contiguous."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise BackendError(f"rms_norm_fp8 expects a row-contiguous 2-D input, got shape {tuple(x.shape)}")
    t, d = x.shape
    if weight.shape != (d,):
        raise BackendError(f"rms_norm_fp8 weight shape {tuple(weight.shape)} does not match hidden size {d}")
    if residual is not None and (residual.shape != x.shape or residual.stride(1) != 1):
        raise BackendError(f"rms_norm_fp8 residual shape {tuple(residual.shape)} != input shape {tuple(x.shape)}")
    act = empty_fp8_act(t, d, x.device, torch.empty_like(x))
    total = torch.empty_like(x) if residual is not None else None
    tp = act.q.shape[0]
    if t:
        block = max(GROUP, triton.next_power_of_2(d))
        on_gpu = x.device.type == "cuda"
        _rms_norm_fp8_kernel[(tp,)](
            x, residual if residual is not None else x, weight, act.x, total if total is not None else x,
            act.q, act.s, act.s_cm, t, d, x.stride(0), residual.stride(0) if residual is not None else 0,
            act.x.stride(0), total.stride(0) if total is not None else 0, act.q.stride(0), act.s.stride(0),
            act.s_cm.stride(1), eps, HAS_RES=residual is not None, ROUND_FIRST=not on_gpu, BLOCK_D=block,
            GROUP=GROUP, num_warps=min(8, max(1, block // 256)),
        )
    return act, total
