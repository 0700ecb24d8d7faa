"""A DeepSeek V2/V3 MoE layer: fp32 router gate, routed + shared experts (a dense MLP) through the backend MoE op.

The per-expert checkpoint tensors (`experts.E.{gate,up,down}_proj`) are held
and stacked by `ExpertWeights`.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.backend import Backend, MoESpec
from deepinfer.models.deepseek_v3.config import DeepseekConfig
from deepinfer.models.layers.experts import ExpertWeights
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mlp import GatedMLP
from deepinfer.models.weights import tensor_loader

_PROJS = ("gate_proj", "up_proj", "down_proj")


class MoELayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.num_experts = cfg.n_routed_experts
        self.hidden_size = D = cfg.hidden_size
        inter = cfg.moe_intermediate_size
        quantized = cfg.quantization == "fp8_block"
        self.router = cfg.router_spec()
        self.use_bias = cfg.topk_method == "noaux_tc"
        self.gate_weight: torch.Tensor | None = None  # [E, D] fp32, as the reference keeps it
        self.e_score_correction_bias: torch.Tensor | None = None  # [E] fp32, selection only
        self.experts = ExpertWeights(cfg.n_routed_experts, D, inter, backend, dtype, quantized, _PROJS)
        self.shared_experts = (
            GatedMLP(D, inter * cfg.n_shared_experts, backend, dtype, quantized=quantized, reduce_output=False)
            if cfg.n_shared_experts
            else None
        )
        self.comm = backend.communicator()
        self.op = backend.make_moe(MoESpec(router=self.router, hidden_size=D, intermediate_size=inter))

    def loaders(self, prefix: str) -> dict[str, Loader]:
        dev = self.backend.device
        name = f"{prefix}.gate.weight"
        out = {name: tensor_loader(self, "gate_weight", name, (self.num_experts, self.hidden_size), torch.float32, dev)}
        if self.use_bias:
            name = f"{prefix}.gate.e_score_correction_bias"
            out[name] = tensor_loader(self, "e_score_correction_bias", name, (self.num_experts,), torch.float32, dev)
        out.update(self.experts.loaders(prefix))
        if self.shared_experts is not None:
            out.update(self.shared_experts.loaders(f"{prefix}.shared_experts"))
        return out

    def finalize(self) -> None:
        self.op.load_experts(*self.experts.stacked())
        if self.shared_experts is not None:
            self.shared_experts.finalize()
            # the op may run the shared MLP as extra experts at small batches; it still calls the
            # module (one dense GEMM per weight) where it does not
            self.op.fuse_shared_experts(*self.shared_experts.dense_weights())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 router gate as the reference; the op may fuse it with the top-k
        out = self.op.forward_hidden(x, self.gate_weight, self.e_score_correction_bias, self.shared_experts)
        return self.comm.all_reduce(out)  # routed + shared: partial sums under tensor / expert parallelism
