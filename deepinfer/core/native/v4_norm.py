"""RMSNorm as DeepSeek-V4 computes it: fp32 statistic, fp32 weight, one cast at the end.

(V2/V3 cast the normalised row to the input dtype before the weight multiplies
it; V4 keeps its norm weights in fp32 and multiplies in fp32, so bf16 results
round differently. fp32 inputs give identical results either way.)
"""

from __future__ import annotations

import torch


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
