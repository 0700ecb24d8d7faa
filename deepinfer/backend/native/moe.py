"""Routed experts in plain torch: route -> per-expert SwiGLU -> weighted combine.

Per-expert matmuls run in the activation dtype like HF's `DeepseekV3Experts`;
the weighted sum over a token's experts is taken in fp32 (HF accumulates in
the activation dtype), then cast back once.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from deepinfer.backend.layer_ops import MoEOp
from deepinfer.backend.native.activation import silu_and_mul
from deepinfer.backend.native.routing import route as native_route
from deepinfer.backend.native.routing import validate_router
from deepinfer.backend.specs import MoESpec
from deepinfer.errors import BackendError

RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t,k]; [T, D] in x's dtype.

    Each (token, slot) result lands in its own row of a [T, k, D] fp32 buffer that
    is summed over k at the end: no scatter-add, so the combine order is fixed
    (slot order) and a token routed twice to one expert (hash tables) is fine.
    A -1 id (a pair another rank computes, expert parallelism) leaves its row zero.
    """
    t, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    buf = torch.zeros((t * top_k, x.shape[1]), dtype=torch.float32, device=x.device)
    flat_ids = topk_ids.reshape(-1)
    flat_w = topk_weights.reshape(-1, 1).float()
    key = torch.where(flat_ids >= 0, flat_ids, num_experts)  # -1 pairs sort after every expert's
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts].tolist()
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        sel = order[start : start + n]  # flat (token, slot) positions routed to expert e
        start += n
        h = silu_and_mul(F.linear(x[sel // top_k], w13[e]), swiglu_limit)
        buf[sel] = F.linear(h, w2[e]).float() * flat_w[sel]
    return buf.view(t, top_k, x.shape[1]).sum(dim=1).to(x.dtype)


class NativeMoE(MoEOp):
    """Dense per-expert loop; the reference for fused / grouped-GEMM MoE kernels.

    Accelerated MoE ops subclass it and override `experts` only: loading,
    routing and the not-loaded check are the same for all of them.
    """

    def __init__(self, spec: MoESpec, route_fn: RouteFn = native_route):
        super().__init__(spec)
        validate_router(spec.router)
        self.route_fn = route_fn
        self.w13: torch.Tensor | None = None
        self.w2: torch.Tensor | None = None

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.check_expert_shapes(w13, w2)
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()

    def replace_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """In place: every kernel (and a captured graph) keeps reading the same tensors."""
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE replace_experts before load_experts")
        self.check_expert_shapes(w13, w2)
        self.w13.copy_(w13)
        self.w2.copy_(w2)

    def expert_parallel_reasons(self) -> list[str]:
        return []

    def route(self, router_logits, correction_bias=None, token_ids=None, tid2eid=None):
        return self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum [T, D] for already-chosen (weights, ids); -1 ids add nothing."""
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE experts before load_experts")
        return experts_forward(x, self.w13, self.w2, topk_weights, topk_ids, self.spec.swiglu_limit)

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        out = self.experts(x, weights, ids)
        if shared_experts is not None:  # the routed sum rounded to x's dtype, then the add (as HF)
            out = out + shared_experts(x)
        return out
