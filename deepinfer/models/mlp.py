"""SwiGLU MLP: the dense layers' MLP and the MoE layers' shared experts."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.core.backend import Backend
from deepinfer.models.linear import Linear, Loader, MergedLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one matmul when they can be fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, backend: Backend, dtype: torch.dtype,
                 quantized: bool = False):
        super().__init__()
        self.backend = backend
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], backend, dtype,
                                         quantized=quantized)
        self.down_proj = Linear(intermediate_size, hidden_size, backend, dtype, quantized=quantized)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        out = self.gate_up_proj.loaders([f"{prefix}.gate_proj", f"{prefix}.up_proj"])
        out.update(self.down_proj.loaders(f"{prefix}.down_proj"))
        return out

    def finalize(self) -> None:
        self.gate_up_proj.finalize()
        self.down_proj.finalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.backend.silu_and_mul(self.gate_up_proj(x)))
