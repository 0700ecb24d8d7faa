"""Routed experts on torch_npu: route -> npu_moe_init_routing_v2 (permute by expert) -> npu_grouped_matmul
(gate + up) -> npu_swiglu -> npu_grouped_matmul (down) -> npu_moe_finalize_routing (weighted unpermute).

Weights are kept as [E, K, N] (x @ w), the grouped matmul's layout, transposed once at load. Dropless,
unquantised: every (token, expert) pair is computed. V4's clamped SwiGLU has no torch_npu operator here;
the backend gives those specs the native op (op_coverage says so).
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from deepinfer.backend import MoESpec, NativeMoE
from deepinfer.errors import BackendError


class AscendMoE(NativeMoE):
    def __init__(self, spec: MoESpec, npu: ModuleType, route_fn: Callable):
        super().__init__(spec, route_fn=route_fn)
        self.npu = npu
        self.w13_kn: torch.Tensor | None = None  # [E, D, 2I]
        self.w2_kn: torch.Tensor | None = None  # [E, I, D]

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.check_expert_shapes(w13, w2)
        self.w13_kn = w13.transpose(1, 2).contiguous()
        self.w2_kn = w2.transpose(1, 2).contiguous()

    def expert_parallel_reasons(self) -> list[str]:
        # npu_moe_init_routing_v2 is handed every id as an expert index; a -1 id (a pair another rank computes)
        # is not documented as skipped, and nothing here was run on an NPU with it (active_expert_range unused)
        return ["AscendMoE: npu_moe_init_routing_v2 is not known to skip -1 expert ids (expert parallelism not "
                "implemented on ascend)"]

    def replace_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        self.load_experts(w13, w2)  # its own transposed copies; NativeMoE's in-place copy needs self.w13

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        if self.w13_kn is None or self.w2_kn is None:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        out = self.experts(x, weights, ids)
        if shared_experts is not None:  # the routed sum rounded to x's dtype, then the add (as the reference)
            out = out + shared_experts(x)
        return out

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        npu, e = self.npu, self.spec.router.num_experts
        if topk_ids.shape[0] == 0:
            return torch.zeros_like(x)
        ids32 = topk_ids.to(torch.int32)
        expanded_x, row_idx, counts, _ = npu.npu_moe_init_routing_v2(
            x, ids32, active_num=-1, expert_capacity=-1, expert_num=e, drop_pad_mode=0, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, quant_mode=-1, active_expert_range=[0, e], row_idx_type=0)
        gate_up = npu.npu_grouped_matmul([expanded_x], [self.w13_kn], group_list=counts, group_type=0,
                                         group_list_type=1, split_item=2)[0]
        act = npu.npu_swiglu(gate_up, dim=-1)
        down = npu.npu_grouped_matmul([act], [self.w2_kn], group_list=counts, group_type=0, group_list_type=1,
                                      split_item=2)[0]
        return npu.npu_moe_finalize_routing(down, None, None, None, topk_weights.to(down.dtype), row_idx, ids32,
                                            drop_pad_mode=2)
