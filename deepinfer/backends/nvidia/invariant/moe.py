"""`InvariantMoE`: the routed experts on one path for every batch size (batch-invariant mode).

Which path: the expert-aligned grouped GEMMs (moe_gemm.aligned_gemm, fused_moe_gemm's aligned kernel
on gemm.mma) with BLOCK_M fixed at
64 (16 under the interpreter) and therefore one tile configuration, whatever the token count. The
default op switches between the direct mode (shared experts folded in as extra experts, a combine
fused into the last program by a counter) and the aligned mode, and picks BLOCK_M and the tile from
the batch; each choice is fine on its own but gives a token different bits in different batches. Here:

- router logits: x @ gate^T in fp32 with exact products: for bf16 x the fp32 gate split into three bf16
  parts (gemm.split_gate / router_linear: one bf16 GEMM on the tensor cores + two adds), else the fp32
  invariant GEMM (gemm.linear);
- top-k: the Triton router, one program per token (moe_routing.route), never the fused GEMV + top-k;
- experts: alignment (any align function: it only orders the pairs, and a pair's row does not depend on
  its place in the tile), gate_up + SiLU-and-mul, down * routing weight (fp32), each row of a pair one
  fixed-order K loop;
- combine: a token's slots summed in slot order in fp32, rounded, plus the shared experts' output (the
  model's dense MLP, whose GEMMs are the invariant ones) -- fused_moe.combine, no atomics.
"""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.backend import MoESpec, NativeMoE
from deepinfer.backends.nvidia.fused_moe import align_skipping, combine
from deepinfer.backends.nvidia.invariant.gemm import interpreting, linear, router_linear, split_gate
from deepinfer.backends.nvidia.invariant.moe_gemm import aligned_gemm
from deepinfer.backends.nvidia.moe import triton_moe_unsupported
from deepinfer.backends.nvidia.moe_routing import moe_align, route
from deepinfer.errors import BackendError

BLOCK_M = 64  # pairs per expert tile, for every batch size


def block_m() -> int:
    return 16 if interpreting() else BLOCK_M


def _route(router_logits, spec, correction_bias=None, token_ids=None, tid2eid=None):
    """The Triton per-token router (route_fn signature); hash routing (V4) is not on this path."""
    if token_ids is not None or tid2eid is not None:
        raise BackendError("invariant MoE: hash routing (token_ids / tid2eid) is not implemented")
    return route(router_logits, spec, correction_bias)


class InvariantMoE(NativeMoE):
    def __init__(self, spec: MoESpec, align_fn: Callable = moe_align):
        reasons = triton_moe_unsupported(spec)
        if reasons:
            raise BackendError("the batch-invariant MoE does not implement: " + ", ".join(reasons))
        super().__init__(spec, route_fn=_route)
        self.align_fn = align_fn
        self._gate_split: tuple[int, torch.Tensor] | None = None  # (the fp32 gate's data_ptr, its split)

    def router_logits(self, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and gate_weight.dtype == torch.float32:
            # the gate is a loaded weight: split once (the first forward, before any graph capture), reused
            if self._gate_split is None or self._gate_split[0] != gate_weight.data_ptr():
                self._gate_split = (gate_weight.data_ptr(), split_gate(gate_weight))
            return router_linear(x, self._gate_split[1])
        return linear(x, gate_weight, out_dtype=torch.float32)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                shared_out: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts (+ shared_out added in the combine); a -1 id (another rank's expert, expert
        parallelism) is left out of the alignment and its zeroed slot adds nothing. The other experts' blocks
        are laid out exactly as without -1 ids, so their bits do not change."""
        T, D = x.shape
        E, two_i, _ = self.w13.shape
        k = topk_ids.shape[1]
        if T == 0:
            return torch.zeros_like(x)
        x = x.contiguous()
        bm = block_m()
        n = T * k
        sorted_ids, expert_ids, num_padded = align_skipping(self.align_fn, topk_ids, E, bm)
        act = torch.empty((n, two_i // 2), dtype=x.dtype, device=x.device)
        aligned_gemm(x, self.w13, act, sorted_ids, expert_ids, num_padded, n, k, bm, dual=True)
        y = torch.zeros((n, D), dtype=torch.float32, device=x.device)
        aligned_gemm(act, self.w2, y, sorted_ids, expert_ids, num_padded, n, 1, bm,
                     topk_weights.float().contiguous().view(-1))
        return combine(y.view(T, k, D), shared_out, x.dtype)

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        if self.w13 is None or self.w2 is None:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        shared_out = shared_experts(x) if shared_experts is not None else None
        return self.experts(x, weights, ids, shared_out)
