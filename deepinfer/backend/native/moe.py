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
from deepinfer.backend.quantized_experts import (
    FP8_EXPERT_SCHEMES,
    INT4_ACT_ORDER,
    INT4_EXPERT_SCHEMES,
    MOE_QUANT_SCHEMES,
    QuantizedExperts,
)
from deepinfer.backend.native.activation import silu_and_mul
from deepinfer.backend.native.linear import dequant_fp8_block
from deepinfer.backend.native.quant_fp4 import dequant_fp4
from deepinfer.backend.native.quant_fp8 import w8a8_block_linear_ref
from deepinfer.backend.native.quant_int4 import dequant_int4_rows
from deepinfer.backend.native.routing import route as native_route
from deepinfer.backend.native.routing import validate_router
from deepinfer.backend.specs import MoESpec
from deepinfer.errors import BackendError

RouteFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def dequant_expert(q: QuantizedExperts, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e of a QuantizedExperts as dense (w13 [2I, D], w2 [D, I]) in `dtype`: dequantized in fp32, rounded
    once, as the linear method's dense_weight densifies a checkpoint's expert at load (so the two runs agree)."""
    if q.scheme in FP8_EXPERT_SCHEMES:
        inter = q.w13.shape[1] // 2
        g = q.w13_scale.shape[1] // 2  # the gate projection's scale rows, then the up projection's
        w13 = torch.cat([dequant_fp8_block(q.w13[e, :inter], q.w13_scale[e, :g]),
                         dequant_fp8_block(q.w13[e, inter:], q.w13_scale[e, g:])])
        w2 = dequant_fp8_block(q.w2[e], q.w2_scale[e])
    elif q.scheme == "fp4":
        w13, w2 = dequant_fp4(q.w13[e], q.w13_scale[e]), dequant_fp4(q.w2[e], q.w2_scale[e])
    elif q.scheme in INT4_EXPERT_SCHEMES:
        g_idx = q.w13_g_idx[e] if q.w13_g_idx is not None else None  # (GPTQ act-order gate / up)
        w13 = dequant_int4_rows(q.w13[e], q.w13_zeros[e], q.w13_scale[e], q.group_size, g_idx)
        w2 = dequant_int4_rows(q.w2[e], q.w2_zeros[e], q.w2_scale[e], q.group_size)
    else:
        raise BackendError(f"QuantizedExperts scheme {q.scheme!r}")
    return w13.to(dtype), w2.to(dtype)


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor | None,
    w2: torch.Tensor | None,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    swiglu_limit: float | None = None,
    quant: QuantizedExperts | None = None,
) -> torch.Tensor:
    """sum_k w[t,k] * down_e(silu(gate_e(x_t)) * up_e(x_t)) for e = ids[t,k]; [T, D] in x's dtype.

    Each (token, slot) result lands in its own row of a [T, k, D] fp32 buffer that
    is summed over k at the end: no scatter-add, so the combine order is fixed
    (slot order) and a token routed twice to one expert (hash tables) is fine.
    A -1 id (a pair another rank computes, expert parallelism) leaves its row zero.
    With `quant` (w13 / w2 None) each expert that got pairs is dequantized for its turn only (dequant_expert):
    the oracle of the quantized MoE kernels, and the weights stay quantized in memory. "fp8_w8a8" experts also
    quantize each projection's input per token per 128 channels and take the product in fp32 on the dequantized
    values (w8a8_block_linear_ref, as the fp8_w8a8 linear method), rounded to x's dtype after each projection.
    """
    t, top_k = topk_ids.shape
    num_experts = (quant.w13 if quant is not None else w13).shape[0]
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
        if quant is not None and quant.scheme == "fp8_w8a8":  # both inputs quantized per token per 128 channels
            w13e, w2e = dequant_expert(quant, e, torch.float32)
            h = silu_and_mul(w8a8_block_linear_ref(x[sel // top_k], w13e), swiglu_limit)
            buf[sel] = w8a8_block_linear_ref(h, w2e).float() * flat_w[sel]
            continue
        w13e, w2e = dequant_expert(quant, e, x.dtype) if quant is not None else (w13[e], w2[e])
        h = silu_and_mul(F.linear(x[sel // top_k], w13e), swiglu_limit)
        buf[sel] = F.linear(h, w2e).float() * flat_w[sel]
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
        self.quant: QuantizedExperts | None = None  # quantized experts (then w13 / w2 stay None)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.check_expert_shapes(w13, w2)
        self.w13, self.w2 = w13.contiguous(), w2.contiguous()
        self.quant = None

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        """Every scheme, for this class's own compute; a subclass that replaces experts() / forward() computes
        from w13 / w2, so it takes none unless it declares its own (the cpu and nvidia ops do)."""
        cls = type(self)
        if cls.experts is NativeMoE.experts and cls.forward is NativeMoE.forward:
            return (*MOE_QUANT_SCHEMES, INT4_ACT_ORDER)
        return ()

    def load_quantized_experts(self, experts: QuantizedExperts) -> None:
        """Keep them as stored; `experts` dequantizes one expert at a time (the oracle of the quantized kernels)."""
        if experts.scheme not in self.quantized_expert_schemes():
            raise BackendError(f"{type(self).__name__} does not run {experts.scheme!r} routed experts")
        if experts.w13_g_idx is not None and INT4_ACT_ORDER not in self.quantized_expert_schemes():
            raise BackendError(f"{type(self).__name__} does not run GPTQ act-order routed experts (w13_g_idx); "
                               f"quantized_expert_schemes() lists {INT4_ACT_ORDER!r} where it does")
        experts.check(self.spec.local_experts, self.spec.hidden_size, self.spec.intermediate_size)
        self.quant, self.w13, self.w2 = experts, None, None

    @property
    def loaded(self) -> bool:
        return self.quant is not None or (self.w13 is not None and self.w2 is not None)

    def replace_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """In place: every kernel (and a captured graph) keeps reading the same tensors."""
        if self.quant is not None:
            raise BackendError("MoE replace_experts: these experts are quantized; moving quantized experts (the "
                               "expert load balancer) is not supported")
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
        if not self.loaded:
            raise BackendError("MoE experts before load_experts")
        return experts_forward(x, self.w13, self.w2, topk_weights, topk_ids, self.spec.swiglu_limit, self.quant)

    def forward(
        self,
        x: torch.Tensor,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
        shared_experts: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if not self.loaded:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        out = self.experts(x, weights, ids)
        if shared_experts is not None:  # the routed sum rounded to x's dtype, then the add (as HF)
            out = out + shared_experts(x)
        return out
