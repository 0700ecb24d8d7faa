"""SwiGLU MLP: the dense layers' MLP and the MoE layers' shared experts."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, Fp8Act
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.linear import Linear, Loader, MergedLinear, tp_communicator
from deepinfer.models.layers.quant import fused_act_quant


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one matmul when they can be fused.

    `swiglu_limit` (V4) clamps gate and up first; `names` are the checkpoint's
    (gate, up, down) names (V4: w1, w3, w2). Tensor parallelism (`tp_split`, on by default): gate and up
    are column-parallel (each rank holds intermediate / tp of both, so the fused gate_up keeps its
    halves), down is row-parallel, so its output is a partial sum over the "tp" group. `reduce_output`:
    that sum is taken here (the communicator's all_reduce; the identity in one process); a MoE layer's
    shared experts leave it to the MoE layer, which reduces routed + shared once. `tp_split=False`
    keeps a whole replica on every rank (its output then needs no reduce).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, backend: Backend, dtype: torch.dtype,
                 quantized: bool = False, swiglu_limit: float | None = None,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), reduce_output: bool = True,
                 tp_split: bool = True):
        super().__init__()
        self.backend = backend
        self.comm = tp_communicator(backend) if reduce_output and tp_split else None
        self.swiglu_limit = swiglu_limit
        self.names = names
        col, row = ("column", "row") if tp_split else (None, None)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], backend, dtype,
                                         quantized=quantized, splits=[col, col])
        self.down_proj = Linear(intermediate_size, hidden_size, backend, dtype, quantized=quantized, split=row)
        # the SiLU-and-mul writes the W8A8 down's e4m3 input (backend/fp8_act.py): the config file's
        # fuse_quant_dequant, else DEEPINFER_FP8_EPILOGUE_QUANT
        self.fp8_epilogue_quant = fused_act_quant()

    def loaders(self, prefix: str) -> dict[str, Loader]:
        gate, up, down = self.names
        out = self.gate_up_proj.loaders([f"{prefix}.{gate}", f"{prefix}.{up}"])
        out.update(self.down_proj.loaders(f"{prefix}.{down}"))
        return out

    def finalize(self) -> None:
        self.gate_up_proj.finalize()
        self.down_proj.finalize()

    def dense_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, D]: gate rows then up rows, down [D, I]) dense in the compute dtype, after finalize.

        For a MoE op that runs this MLP inside its expert GEMMs (MoEOp.fuse_shared_experts); the
        tensors are the ones forward multiplies by (no copy) when gate and up are fused.
        """
        if self.swiglu_limit is not None:
            raise ModelLoadError("dense_weights: a clamped (swiglu_limit) MLP cannot run as plain SwiGLU experts")
        merged = self.gate_up_proj
        if merged.fused is not None:
            gate_up = merged.fused.dense()
        else:
            gate_up = torch.cat([p.dense() for p in merged.parts], dim=0)
        return gate_up, self.down_proj.dense()

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """Whether forward reads its input as Fp8Act at this token count (its gate_up is fp8 W8A8 above the size
        that GEMM quantizes on load), so the norm before it writes the e4m3 values."""
        return self.swiglu_limit is None and self.gate_up_proj.takes_fp8_act(num_tokens)

    def forward(self, x: torch.Tensor | Fp8Act) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.fp8_epilogue_quant and self.swiglu_limit is None and gate_up.dim() == 2 \
                and self.down_proj.takes_fp8_act(gate_up.shape[0]):
            h = self.backend.silu_and_mul_fp8(gate_up)  # quantized in the same pass for the W8A8 down
        else:
            h = self.backend.silu_and_mul(gate_up, self.swiglu_limit)
        out = self.down_proj(h)
        return out if self.comm is None else self.comm.all_reduce(out)
