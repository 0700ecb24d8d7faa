"""The routed-experts layer on NVIDIA: Triton router -> expert-sorted blocks -> fused grouped GEMMs."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.backends.nvidia.fused_moe import fused_moe
from deepinfer.backends.nvidia.moe_routing import moe_align
from deepinfer.core.backend import MoEOp, MoESpec
from deepinfer.errors import BackendError

TRITON_SCORING = ("softmax", "sigmoid")
TRITON_TOPK = ("greedy", "group_limited_greedy", "noaux_tc")


def triton_moe_unsupported(spec: MoESpec) -> list[str]:
    """Why the fused Triton MoE cannot run this layer (the backend then uses the native op and says so)."""
    reasons = []
    if spec.router.scoring_func not in TRITON_SCORING:
        reasons.append(f"scoring_func {spec.router.scoring_func!r}")
    if spec.router.topk_method not in TRITON_TOPK:
        reasons.append(f"topk_method {spec.router.topk_method!r}")
    if spec.swiglu_limit is not None:
        reasons.append("swiglu_limit (V4 clamped SwiGLU)")
    return reasons


class TritonMoE(MoEOp):
    def __init__(self, spec: MoESpec, route_fn: Callable, align_fn: Callable = moe_align):
        super().__init__(spec)
        reasons = triton_moe_unsupported(spec)
        if reasons:
            raise BackendError("the Triton MoE does not implement: " + ", ".join(reasons))
        self.route_fn = route_fn
        self.align_fn = align_fn
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.check_expert_shapes(w13, w2)
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor, correction_bias: torch.Tensor | None = None,
                token_ids: torch.Tensor | None = None, tid2eid: torch.Tensor | None = None) -> torch.Tensor:
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        return fused_moe(x, self.w13, self.w2, weights, ids, align=self.align_fn)
