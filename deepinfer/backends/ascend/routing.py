"""Expert selection on Ascend: npu_moe_gating_top_k where its documented limits take the router, our
Triton kernel for the softmax greedy router where they do not, torch for the rest (V4's routers)."""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backend import RouterSpec, validate_router
from deepinfer.backends.ascend.router_kernel import kernel_reasons
from deepinfer.backends.ascend.versions import gating_top_k_reasons


def route_impl(spec: RouterSpec, version: tuple[int, int, int], kernels: bool) -> str:
    """"gating_top_k" | "triton" | "native (<why>)": what computes this router here."""
    if not gating_top_k_reasons(spec, version):
        return "gating_top_k"
    why = gating_top_k_reasons(spec, version)
    if spec.scoring_func == "softmax" and spec.topk_method == "greedy" and not kernel_reasons(spec.num_experts,
                                                                                              spec.top_k):
        if kernels:
            return "triton"
        why = why + ["the Triton router runs only on an NPU or under TRITON_INTERPRET=1"]
    return f"native ({'; '.join(why)})"


def gating_top_k(npu: ModuleType, router_logits: torch.Tensor, spec: RouterSpec,
                 correction_bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The DeepSeek router through npu_moe_gating_top_k (fp32 logits in, fp32 weights / int64 ids out)."""
    grouped = spec.topk_method in ("group_limited_greedy", "noaux_tc") and spec.n_group > 1
    bias = correction_bias.float() if spec.topk_method == "noaux_tc" and correction_bias is not None else None
    weights, ids, _ = npu.npu_moe_gating_top_k(
        router_logits.float(), spec.top_k, bias=bias,
        k_group=spec.topk_group if grouped else 1, group_count=spec.n_group if grouped else 1,
        group_select_mode=1 if spec.topk_method == "noaux_tc" else 0, renorm=0,
        norm_type=1 if spec.scoring_func == "sigmoid" else 0, out_flag=False,
        routed_scaling_factor=float(spec.routed_scaling_factor), eps=1e-20,
    )
    return weights.float(), ids.to(torch.int64)


def route(npu: ModuleType, version: tuple[int, int, int], kernels: bool, router_logits: torch.Tensor,
          spec: RouterSpec, correction_bias: torch.Tensor | None, native) -> tuple[torch.Tensor, torch.Tensor]:
    """`native` is the torch fallback (NativeOps.route bound to the backend)."""
    validate_router(spec)
    how = route_impl(spec, version, kernels)
    if how == "gating_top_k":
        if spec.topk_method == "noaux_tc" and correction_bias is None:
            return native()  # the native router raises the error that names the missing bias
        return gating_top_k(npu, router_logits, spec, correction_bias)
    if how == "triton":
        from deepinfer.backends.ascend.router_kernel import softmax_greedy_topk

        return softmax_greedy_topk(router_logits, spec.top_k, spec.norm_topk_prob, spec.routed_scaling_factor)
    return native()
