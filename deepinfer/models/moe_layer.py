"""A DeepSeek MoE layer: fp32 router gate + routed experts (backend MoE op) + shared experts (dense MLP).

Checkpoints store one tensor per expert (`experts.E.{gate,up,down}_proj`);
they are densified through the backend's linear method (so fp8 experts are
dequantized by the backend, not here) and stacked into w13 / w2 for the op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.core.backend import Backend, MoESpec
from deepinfer.models.deepseek_config import DeepseekConfig
from deepinfer.models.linear import Linear, Loader
from deepinfer.models.mlp import GatedMLP
from deepinfer.models.weights import tensor_loader


class MoELayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.dtype = dtype
        self.num_experts = E = cfg.n_routed_experts
        self.hidden_size = D = cfg.hidden_size
        self.intermediate_size = inter = cfg.moe_intermediate_size
        quantized = cfg.quantization == "fp8_block"
        self.router = cfg.router_spec()
        self.use_bias = cfg.topk_method == "noaux_tc"
        self.gate_weight: torch.Tensor | None = None  # [E, D] fp32, as the reference keeps it
        self.e_score_correction_bias: torch.Tensor | None = None  # [E] fp32, selection only
        self.experts = nn.ModuleList(
            nn.ModuleList(
                [
                    Linear(D, inter, backend, dtype, quantized=quantized),  # gate_proj
                    Linear(D, inter, backend, dtype, quantized=quantized),  # up_proj
                    Linear(inter, D, backend, dtype, quantized=quantized),  # down_proj
                ]
            )
            for _ in range(E)
        )
        self.shared_experts = (
            GatedMLP(D, inter * cfg.n_shared_experts, backend, dtype, quantized=quantized)
            if cfg.n_shared_experts
            else None
        )
        self.op = backend.make_moe(MoESpec(router=self.router, hidden_size=D, intermediate_size=inter))

    def loaders(self, prefix: str) -> dict[str, Loader]:
        dev = self.backend.device
        name = f"{prefix}.gate.weight"
        out = {name: tensor_loader(self, "gate_weight", name, (self.num_experts, self.hidden_size), torch.float32, dev)}
        if self.use_bias:
            name = f"{prefix}.gate.e_score_correction_bias"
            out[name] = tensor_loader(self, "e_score_correction_bias", name, (self.num_experts,), torch.float32, dev)
        for e, (gate, up, down) in enumerate(self.experts):
            out.update(gate.loaders(f"{prefix}.experts.{e}.gate_proj"))
            out.update(up.loaders(f"{prefix}.experts.{e}.up_proj"))
            out.update(down.loaders(f"{prefix}.experts.{e}.down_proj"))
        if self.shared_experts is not None:
            out.update(self.shared_experts.loaders(f"{prefix}.shared_experts"))
        return out

    def finalize(self) -> None:
        E, D, inter = self.num_experts, self.hidden_size, self.intermediate_size
        dev = self.backend.device
        w13 = torch.empty((E, 2 * inter, D), dtype=self.dtype, device=dev)
        w2 = torch.empty((E, D, inter), dtype=self.dtype, device=dev)
        for e, (gate, up, down) in enumerate(self.experts):
            w13[e, :inter] = gate.dense()
            w13[e, inter:] = up.dense()
            w2[e] = down.dense()
        self.experts = nn.ModuleList()  # per-expert copies are dropped once stacked
        self.op.load_experts(w13, w2)
        if self.shared_experts is not None:
            self.shared_experts.finalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x.float(), self.gate_weight)
        out = self.op.forward(x, router_logits, self.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
