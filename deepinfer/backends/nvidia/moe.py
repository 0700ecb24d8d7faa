"""The routed-experts layer on NVIDIA: Triton router -> expert-sorted blocks -> fused grouped GEMMs."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.backends.nvidia.fused_moe import fused_moe
from deepinfer.backends.nvidia.moe_routing import GROUPING_CODES, SCORING_CODES, moe_align
from deepinfer.core.backend import MoESpec
from deepinfer.core.native.moe import NativeMoE
from deepinfer.errors import BackendError

TRITON_SCORING = tuple(SCORING_CODES)
TRITON_TOPK = tuple(GROUPING_CODES)


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


class TritonMoE(NativeMoE):
    """NativeMoE's loading and routing (route_fn: the backend's Triton / CUDA router), fused grouped GEMMs."""

    def __init__(self, spec: MoESpec, route_fn: Callable, align_fn: Callable = moe_align):
        reasons = triton_moe_unsupported(spec)
        if reasons:
            raise BackendError("the Triton MoE does not implement: " + ", ".join(reasons))
        super().__init__(spec, route_fn=route_fn)
        self.align_fn = align_fn

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.w13, self.w2, topk_weights, topk_ids, align=self.align_fn)
