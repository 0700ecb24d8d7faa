"""RMSNorm and fused residual-add + RMSNorm in Triton: one pass over each row.

Math follows Hugging Face DeepSeek: normalise in fp32, round to the input
dtype, then scale by the weight (so results match the torch-native op bit
for bit up to the final rounding).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, offs, mask, w_mask, D, stride_x, stride_r, stride_s, eps,
                 HAS_RES: tl.constexpr):
    """One row's RMSNorm, the weight product in fp32 (the caller rounds it to the output dtype): of x + residual
    when HAS_RES (the sum rounded to x's dtype and stored at sum_ptr), the statistic in fp32, the normalized row
    rounded to x's dtype. Shared with the norm that also quantizes its output (quant/rmsnorm_fp8.py), so that the
    two give the same bits."""
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_s + offs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / D
    y = (xf * tl.rsqrt(var + eps)).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=w_mask, other=0.0)
    return y.to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr,
    D, stride_x, stride_r, stride_o, stride_s, eps,
    HAS_RES: tl.constexpr, BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    out = rms_norm_row(x_ptr, res_ptr, w_ptr, sum_ptr, row, offs, mask, mask, D, stride_x, stride_r, stride_s, eps,
                       HAS_RES)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    from deepinfer.errors import BackendError

    if x.dim() != 2 or x.stride(-1) != 1:
        raise BackendError(f"rms_norm expects a row-contiguous 2-D input, got shape {tuple(x.shape)}")
    if weight.shape != (x.shape[1],):
        raise BackendError(f"rms_norm weight shape {tuple(weight.shape)} does not match hidden size {x.shape[1]}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    _check(x2, weight)
    out = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2, weight, out, out, x2.shape[1], x2.stride(0), 0, out.stride(0), 0, eps,
            HAS_RES=False, BLOCK_D=block, num_warps=min(8, max(1, block // 256)),
        )
    return out.view(shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one kernel."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    r2 = residual.reshape(-1, shape[-1])
    _check(x2, weight)
    if r2.shape != x2.shape or r2.stride(-1) != 1:
        from deepinfer.errors import BackendError

        raise BackendError(f"add_rms_norm residual shape {tuple(residual.shape)} != input shape {tuple(shape)}")
    out = torch.empty_like(x2)
    total = torch.empty_like(x2)
    if x2.shape[0]:
        block = triton.next_power_of_2(x2.shape[1])
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, total, x2.shape[1], x2.stride(0), r2.stride(0), out.stride(0),
            total.stride(0), eps, HAS_RES=True, BLOCK_D=block, num_warps=min(8, max(1, block // 256)),
        )
    return out.view(shape), total.view(shape)
