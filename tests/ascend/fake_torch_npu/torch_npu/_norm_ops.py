"""npu_rms_norm, npu_add_rms_norm, npu_swiglu: computed in fp32, rounded once to the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from torch_npu._checks import FLOATS, dtype_in


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, rstd): y = x * rsqrt(mean(x^2) + eps) * gamma over the trailing dims of gamma's shape; rstd fp32."""
    dtype_in("x", x, FLOATS)
    if tuple(x.shape[-gamma.dim():]) != tuple(gamma.shape):
        raise ValueError(f"npu_rms_norm: gamma {tuple(gamma.shape)} must match x's trailing dims {tuple(x.shape)}")
    dims_ = tuple(range(-gamma.dim(), 0))
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=dims_, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_add_rms_norm(x1: torch.Tensor, x2: torch.Tensor, gamma: torch.Tensor,
                     epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y, rstd, x): x = x1 + x2 (rounded to the input dtype), y = rms_norm(x) * gamma."""
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError("npu_add_rms_norm: x1 and x2 must have one shape and dtype")
    x = (x1.float() + x2.float()).to(x1.dtype)
    y, rstd = npu_rms_norm(x, gamma, epsilon)
    return y, rstd, x


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """x split in two halves along dim: silu(first) * second, computed in fp32."""
    dtype_in("x", x, FLOATS)
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: dim {dim} has odd size {x.shape[dim]}")
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)
