"""DeepSeek-V4 MoE block: routed experts (backend MoE op) + one shared expert, both SwiGLU-clamped.

Routing: scores = sqrt(softplus(logits)) (or the configured scoring_func);
`moe` layers select the top-k of scores + e_score_correction_bias (bias for
selection only), `hash_moe` layers take the experts from the frozen
tid2eid[token_id] table. The weights are the unbiased scores of the chosen
experts, normalised to sum 1 (always, as the reference does), times
routed_scaling_factor. Checkpoint names follow DeepSeek's release:
experts.E.w1 (gate), w3 (up), w2 (down).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.backend import Backend, MoESpec, RouterSpec
from deepinfer.errors import ModelLoadError
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.layers.experts import ExpertWeights
from deepinfer.models.layers.linear import Loader
from deepinfer.models.layers.mlp import GatedMLP
from deepinfer.models.weights import tensor_loader


class V4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_id: int, backend: Backend, dtype: torch.dtype):
        super().__init__()
        self.backend = backend
        self.is_hash = cfg.mlp_layer_types[layer_id] == "hash_moe"
        E, D, inter, k = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
        self.E, self.D, self.k, self.vocab = E, D, k, cfg.vocab_size
        q8 = cfg.quantization == "fp8_block"
        self.router = RouterSpec(
            num_experts=E, top_k=k, scoring_func=cfg.scoring_func, topk_method="hash" if self.is_hash else "noaux_tc",
            n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=cfg.routed_scaling_factor,
        )
        self.gate_weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None
        self.tid2eid: torch.Tensor | None = None
        self.experts = ExpertWeights(E, D, inter, backend, dtype, q8, ("w1", "w3", "w2"))
        self.shared = GatedMLP(D, inter, backend, dtype, quantized=q8, swiglu_limit=cfg.swiglu_limit,
                               names=("w1", "w3", "w2"), reduce_output=False)
        self.comm = backend.communicator()
        self.op = backend.make_moe(MoESpec(router=self.router, hidden_size=D, intermediate_size=inter,
                                           swiglu_limit=cfg.swiglu_limit))

    def _set_tid2eid(self, name: str):
        def load(t: torch.Tensor) -> None:
            if tuple(t.shape) != (self.vocab, self.k):
                raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {(self.vocab, self.k)}")
            if t.is_floating_point() or t.is_complex():
                raise ModelLoadError(f"{name} has dtype {t.dtype}; expected an integer table")
            if int(t.min()) < 0 or int(t.max()) >= self.E:
                raise ModelLoadError(f"{name} holds expert ids outside [0, {self.E})")
            self.tid2eid = t.to(device=self.backend.device, dtype=torch.long)
        return load

    def loaders(self, p: str) -> dict[str, Loader]:
        dev, f32 = self.backend.device, torch.float32
        out = {f"{p}.gate.weight": tensor_loader(self, "gate_weight", f"{p}.gate.weight", (self.E, self.D), f32, dev)}
        if self.is_hash:
            out[f"{p}.gate.tid2eid"] = self._set_tid2eid(f"{p}.gate.tid2eid")
        else:
            out[f"{p}.gate.bias"] = tensor_loader(self, "bias", f"{p}.gate.bias", (self.E,), f32, dev)
        out.update(self.experts.loaders(p))
        out.update(self.shared.loaders(f"{p}.shared_experts"))
        return out

    def finalize(self) -> None:
        self.op.load_experts(*self.experts.stacked())
        self.shared.finalize()

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        logits = F.linear(x.float(), self.gate_weight)
        if self.is_hash:
            routed = self.op.forward(x, logits, token_ids=token_ids, tid2eid=self.tid2eid)
        else:
            routed = self.op.forward(x, logits, correction_bias=self.bias)
        return self.comm.all_reduce(routed + self.shared(x))  # partial sums under tensor / expert parallelism
