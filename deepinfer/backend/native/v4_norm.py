"""RMSNorm as DeepSeek-V4 rounds it.

With a weight (V4's layer norms): fp32 statistic, fp32 weight, one cast at the end. V2/V3 cast
the normalised row to the input dtype before the weight multiplies it; V4 keeps its norm weights
in fp32 and multiplies in fp32, so bf16 results round differently (fp32 inputs agree either way).

Without a weight (V4's per-head q norm and the hyper-connections' norm): the statistic in fp32,
the product x * rsqrt(...) in x's dtype, as the reference writes it.
"""

from __future__ import annotations

import torch


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if weight is None:
        return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * h).to(x.dtype)
