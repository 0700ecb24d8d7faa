"""SwiGLU activation: silu(gate) * up, with V4's optional clamp."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.errors import BackendError


def silu_and_mul(x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:], in x's dtype (as HF's act_fn(gate) * up).

    With `limit` (DeepSeek V4 `swiglu_limit`) the gate is clamped from above and
    the up projection to [-limit, limit] first, as `DeepseekV4Experts._apply_gate`.
    """
    if x.shape[-1] % 2:
        raise BackendError(f"silu_and_mul: last dim {x.shape[-1]} is odd; expected gate and up halves")
    gate, up = x.chunk(2, dim=-1)
    if limit is not None:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
