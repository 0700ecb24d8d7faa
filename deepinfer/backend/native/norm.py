"""RMSNorm as Hugging Face's DeepSeek V2/V3 modules compute it.

The variance and the normalisation run in fp32; the normalised row is cast
back to the input dtype *before* the weight multiplies it, exactly as
`DeepseekV3RMSNorm.forward` does, so bf16 results round the same way.
"""

from __future__ import annotations

import torch

from deepinfer.errors import BackendError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] != weight.shape[-1]:
        raise BackendError(f"rms_norm: last dim of x ({x.shape[-1]}) != weight size ({weight.shape[-1]})")
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return (weight * h.to(dtype)).to(dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual); the sum is taken in the input dtype like HF's residual add."""
    if x.shape != residual.shape:
        raise BackendError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    summed = x + residual
    return rms_norm(summed, weight, eps), summed
