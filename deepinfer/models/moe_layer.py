"""A DeepSeek MoE layer: fp32 router gate + routed experts (backend MoE op) + shared experts (dense MLP).

Checkpoints store one tensor per expert (`experts.E.{gate,up,down}_proj`).
They are held as plain tensors while loading (V3 has 44k of them, too many
to make modules of), then densified through the backend's linear method (so
fp8 experts are dequantized by the backend, not here) and stacked into
w13 / w2 for the MoE op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.core.backend import Backend, MoESpec
from deepinfer.errors import ModelLoadError
from deepinfer.models.deepseek_config import DeepseekConfig
from deepinfer.models.linear import Linear, Loader, prepare_scale, prepare_weight
from deepinfer.models.mlp import GatedMLP
from deepinfer.models.weights import tensor_loader

_PROJS = ("gate_proj", "up_proj", "down_proj")


class MoELayer(nn.Module):
    def __init__(self, cfg: DeepseekConfig, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.dtype = dtype
        self.num_experts = cfg.n_routed_experts
        self.hidden_size = D = cfg.hidden_size
        self.intermediate_size = inter = cfg.moe_intermediate_size
        self.quantized = quantized = cfg.quantization == "fp8_block"
        self.router = cfg.router_spec()
        self.use_bias = cfg.topk_method == "noaux_tc"
        self.gate_weight: torch.Tensor | None = None  # [E, D] fp32, as the reference keeps it
        self.e_score_correction_bias: torch.Tensor | None = None  # [E] fp32, selection only
        self._loaded: dict[tuple[int, str, str], torch.Tensor] = {}  # (expert, proj, "weight"|"scale") -> tensor
        self.prefix = ""
        self.shared_experts = (
            GatedMLP(D, inter * cfg.n_shared_experts, backend, dtype, quantized=quantized)
            if cfg.n_shared_experts
            else None
        )
        self.op = backend.make_moe(MoESpec(router=self.router, hidden_size=D, intermediate_size=inter))

    def _shape(self, proj: str) -> tuple[int, int]:
        return (self.hidden_size, self.intermediate_size) if proj == "down_proj" else (self.intermediate_size,
                                                                                       self.hidden_size)

    def _expert_loader(self, e: int, proj: str, kind: str) -> Loader:
        name = f"{self.prefix}.experts.{e}.{proj}"
        out_f, in_f = self._shape(proj)
        dev = self.backend.device

        def load(t: torch.Tensor) -> None:
            if kind == "weight":
                self._loaded[(e, proj, kind)] = prepare_weight(name, t, (out_f, in_f), self.quantized, self.dtype, dev)
            else:
                self._loaded[(e, proj, kind)] = prepare_scale(name, t, out_f, in_f, dev)

        return load

    def loaders(self, prefix: str) -> dict[str, Loader]:
        self.prefix = prefix
        dev = self.backend.device
        name = f"{prefix}.gate.weight"
        out = {name: tensor_loader(self, "gate_weight", name, (self.num_experts, self.hidden_size), torch.float32, dev)}
        if self.use_bias:
            name = f"{prefix}.gate.e_score_correction_bias"
            out[name] = tensor_loader(self, "e_score_correction_bias", name, (self.num_experts,), torch.float32, dev)
        for e in range(self.num_experts):
            for proj in _PROJS:
                out[f"{prefix}.experts.{e}.{proj}.weight"] = self._expert_loader(e, proj, "weight")
                if self.quantized:
                    out[f"{prefix}.experts.{e}.{proj}.weight_scale_inv"] = self._expert_loader(e, proj, "scale")
        if self.shared_experts is not None:
            out.update(self.shared_experts.loaders(f"{prefix}.shared_experts"))
        return out

    def _dense(self, e: int, proj: str) -> torch.Tensor:
        """One expert matrix as dense compute-dtype [out, in], through the backend's linear method."""
        out_f, in_f = self._shape(proj)
        lin = Linear(in_f, out_f, self.backend, self.dtype, quantized=self.quantized)
        lin.name = f"{self.prefix}.experts.{e}.{proj}"
        if (e, proj, "weight") not in self._loaded:
            raise ModelLoadError(f"{lin.name}.weight was never loaded")
        lin.weight = self._loaded.pop((e, proj, "weight"))
        lin.weight_scale_inv = self._loaded.pop((e, proj, "scale"), None)
        return lin.dense()

    def finalize(self) -> None:
        E, D, inter = self.num_experts, self.hidden_size, self.intermediate_size
        dev = self.backend.device
        w13 = torch.empty((E, 2 * inter, D), dtype=self.dtype, device=dev)
        w2 = torch.empty((E, D, inter), dtype=self.dtype, device=dev)
        for e in range(E):
            w13[e, :inter] = self._dense(e, "gate_proj")
            w13[e, inter:] = self._dense(e, "up_proj")
            w2[e] = self._dense(e, "down_proj")
        self.op.load_experts(w13, w2)
        if self.shared_experts is not None:
            self.shared_experts.finalize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x.float(), self.gate_weight)
        out = self.op.forward(x, router_logits, self.e_score_correction_bias)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
