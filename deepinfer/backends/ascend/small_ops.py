"""The small fused ops on torch_npu: RMSNorm, add + RMSNorm, SwiGLU.

The NPU operators compute in fp32 and round once to the input dtype (the torch-native reference
rounds the normalised row before the weight multiplies it, as Hugging Face does): within the
conformance suite's low-precision tolerances, not bitwise equal. RoPE and the generic KV write run
as torch ops on the device (npu_interleave_rope de-interleaves its output, which the contract's
rotary_embedding must not do; the MLA op uses it where the permutation is invisible).
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.errors import BackendError


def rms_norm(npu: ModuleType, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.shape[-1] != weight.shape[-1]:
        raise BackendError(f"rms_norm: last dim of x ({x.shape[-1]}) != weight size ({weight.shape[-1]})")
    return npu.npu_rms_norm(x, weight.to(x.dtype), epsilon=eps)[0]


def add_rms_norm(npu: ModuleType, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if x.shape != residual.shape:
        raise BackendError(f"add_rms_norm: x {tuple(x.shape)} and residual {tuple(residual.shape)} differ in shape")
    y, _rstd, summed = npu.npu_add_rms_norm(x, residual, weight.to(x.dtype), epsilon=eps)
    return y, summed


def silu_and_mul(npu: ModuleType, x: torch.Tensor) -> torch.Tensor:
    if x.shape[-1] % 2:
        raise BackendError(f"silu_and_mul: last dim {x.shape[-1]} is odd; expected gate and up halves")
    return npu.npu_swiglu(x, dim=-1)
