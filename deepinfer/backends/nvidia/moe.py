"""The routed-experts layer on NVIDIA: Triton / CUDA router -> fused grouped GEMMs -> one combine kernel.

Small batches run fused_moe's direct mode, with the shared experts (when
offered through fuse_shared_experts, or fuse_shared_quantized beside quantized
routed experts) folded in as extra experts; larger ones
the expert-aligned mode with the shared MLP run densely by the model's
module (one read of its weights) and only its add fused into the combine
(DEEPINFER_MOE_FOLD_SHARED_ALIGNED=N: up to N tokens, quantized shared experts stacked
by fuse_shared_quantized take every token's last slots in the aligned GEMMs too,
which saves the MLP's own launches and, under W8A8, its activation quant).
The choice depends on the batch size alone, so it is fixed per CUDA graph.
Up to 16 tokens `forward_hidden` also fuses the router GEMV with the top-k
(moe_routing.fused_router_max_tokens: DEEPINFER_MOE_FUSED_ROUTER_MAX_TOKENS up to 64 for A/B runs,
DEEPINFER_MOE_FUSED_ROUTER=0: GEMV, then the CUDA C++ / Triton top-k).

In the aligned mode the dense shared MLP runs on a second CUDA stream, forked
before the router and joined just before the combine: its GEMMs overlap the
router, top-k and alignment kernels, which are latency-bound at decode sizes
and leave most of the GPU idle (DEEPINFER_MOE_SHARED_STREAM=0 runs it inline).
The fork and join are stream-event edges, so a captured CUDA graph keeps them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer import envs
from deepinfer.backend import INT4_ACT_ORDER, MOE_QUANT_SCHEMES, Fp8Act, MoESpec, NativeMoE, QuantizedExperts
from deepinfer.backends.nvidia.fused_moe import counters_for, fused_moe, use_direct
from deepinfer.backends.nvidia.fused_moe_config import FP8_ACT
from deepinfer.backends.nvidia.moe_routing import (
    GROUPING_CODES,
    ROUTER_GEMV_MAX_TOKENS,
    SCORING_CODES,
    fused_router_max_tokens,
    gate_route,
    moe_align,
    router_logits,
)
from deepinfer.backends.nvidia.quant.act_order import sort_act_order_columns
from deepinfer.errors import BackendError

TRITON_SCORING = tuple(SCORING_CODES)
TRITON_TOPK = tuple(GROUPING_CODES)


def check_shared_mlp(spec, gate_up: torch.Tensor, down: torch.Tensor, w13: torch.Tensor | None) -> None:
    """What folding a shared MLP into the grouped GEMMs needs (the default and invariant MoE ops): gate_up [2*S*I, D],
    down [D, S*I] over the op's hidden D and expert intermediate I, and the routed experts loaded first."""
    d, i = spec.hidden_size, spec.intermediate_size
    if gate_up.dim() != 2 or down.dim() != 2 or gate_up.shape[1] != d or down.shape[0] != d \
            or down.shape[1] % i or gate_up.shape[0] != 2 * down.shape[1]:
        raise BackendError(f"fuse_shared_experts: gate_up {tuple(gate_up.shape)} / down {tuple(down.shape)} are "
                           f"not a shared MLP of n * {i} intermediate over hidden {d}")
    if w13 is None:
        raise BackendError("fuse_shared_experts before load_experts")


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
        self.shared_w: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [2SI, D], down [D, SI])
        self.counters: torch.Tensor | None = None  # the direct mode's fused-combine counters (made at load)
        self.route_counters: torch.Tensor | None = None  # the fused router's per-token counters
        self.side_stream = None  # torch.cuda.Stream for the shared MLP (made at load, before any capture)
        self.quant_shared: QuantizedExperts | None = None  # routed + shared experts stacked (fuse_shared_quantized)
        self.w13_perm: torch.Tensor | None = None  # act-order experts' sorted gate / up columns (quant/act_order.py)

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().load_experts(w13, w2)
        self.counters = counters_for(self.spec.hidden_size, w13.device)  # before any graph capture
        self.route_counters = torch.zeros(ROUTER_GEMV_MAX_TOKENS, dtype=torch.int32, device=w13.device)
        if w13.is_cuda:
            self.side_stream = torch.cuda.Stream(device=w13.device)

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        """fp8 block, fp4 and int4 (AWQ / GPTQ) experts: dequantized in the grouped GEMMs' inner loop (W8A16 /
        W4A16)."""
        return (*MOE_QUANT_SCHEMES, INT4_ACT_ORDER)  # (act-order: columns sorted by group at load, quant/act_order.py)

    def load_quantized_experts(self, experts: QuantizedExperts) -> None:
        """GPTQ act-order gate / up projections (w13_g_idx) are re-laid with their columns sorted by group
        (quant/act_order.py): self.quant then holds that layout (no w13_g_idx) and self.w13_perm the order in which
        the kernels gather the activations (DEEPINFER_INT4_ACT_ORDER_SORT=0: as stored, groups gathered per
        channel)."""
        self.w13_perm = None
        if experts.w13_g_idx is not None and envs.INT4_ACT_ORDER_SORT.get():
            experts, self.w13_perm = sort_act_order_columns(experts)
        super().load_quantized_experts(experts)
        dev = experts.w13.device
        self.shared_w = None
        self.quant_shared = None
        self.counters = counters_for(self.spec.hidden_size, dev)
        self.route_counters = torch.zeros(ROUTER_GEMV_MAX_TOKENS, dtype=torch.int32, device=dev)
        if experts.w13.is_cuda:
            self.side_stream = torch.cuda.Stream(device=dev)

    def _gemm_weights(self, with_shared: bool = False) -> dict:
        """fused_moe's weight arguments: dense w13 / w2, or the quantized ones with their scales (with_shared: the
        stacked routed + shared experts of fuse_shared_quantized)."""
        q = self.quant_shared if with_shared else self.quant
        if q is None:
            return {"w13": self.w13, "w2": self.w2}
        out = {"w13": q.w13, "w2": q.w2, "scheme": q.scheme, "w13_scale": q.w13_scale, "w2_scale": q.w2_scale}
        if q.w13_zeros is not None:  # int4: zero points and the group size (and GPTQ act-order's groups)
            out.update(w13_zeros=q.w13_zeros, w2_zeros=q.w2_zeros, group_size=q.group_size, w13_g_idx=q.w13_g_idx,
                       w13_perm=None if with_shared else self.w13_perm)
        if with_shared:
            out["stacked_shared"] = q.w13.shape[0] - self.quant.w13.shape[0]
        return out

    def fuse_shared_quantized(self, shared: QuantizedExperts) -> bool:
        """Quantized shared experts as extra slots after the routed ones, in one set of tensors (one copy of the
        routed experts: self.quant becomes views of its first E slots), which the direct GEMMs index as routed
        experts E..E+S-1 with weight 1.0. The model's shared MLP still runs the aligned schedule unless
        DEEPINFER_MOE_FOLD_SHARED_ALIGNED folds them there too."""
        q = self.quant
        fields = ("w13", "w13_scale", "w2", "w2_scale", "w13_zeros", "w2_zeros")
        if q is None or shared.scheme != q.scheme or shared.group_size != q.group_size:
            return False
        if q.w13_g_idx is not None or shared.w13_g_idx is not None or self.w13_perm is not None:
            return False  # GPTQ act-order experts: the model's shared MLP runs (the direct GEMMs take no stack)
        for f in fields:
            a, b = getattr(q, f), getattr(shared, f)
            if (a is None) != (b is None) or (a is not None and (a.shape[1:] != b.shape[1:] or a.dtype != b.dtype)):
                return False
        e = q.w13.shape[0]
        stacked = {f: None if getattr(q, f) is None else torch.cat([getattr(q, f), getattr(shared, f).to(
            getattr(q, f).device)]) for f in fields}
        self.quant_shared = QuantizedExperts(q.scheme, **stacked, group_size=q.group_size)
        self.quant = QuantizedExperts(q.scheme, **{f: None if t is None else t[:e] for f, t in stacked.items()},
                                      group_size=q.group_size)
        return True

    def fuse_shared_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        if self.quant is not None:
            return False  # the direct kernel folds dense shared experts only beside dense routed ones
        check_shared_mlp(self.spec, gate_up, down, self.w13)
        if gate_up.dtype != self.w13.dtype or down.dtype != self.w13.dtype:
            return False  # the kernel reads both from one dtype; the model's MLP runs instead
        self.shared_w = (gate_up.contiguous(), down.contiguous())
        return True

    def router_logits(self, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        return router_logits(x, gate_weight)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's entry: -1 pairs are left out of the alignment and of the direct GEMMs, and the
        slot buffer is zeroed for them (forward's own path, which never sees -1, keeps it uninitialized)."""
        if not self.loaded:
            raise BackendError("MoE experts before load_experts")
        return fused_moe(x, topk_weights=topk_weights, topk_ids=topk_ids, align=self.align_fn, counters=self.counters,
                         skip_unrouted=True, **self._gemm_weights())

    def takes_fp8_act(self, num_tokens: int) -> bool:
        """W8A8 routed experts on the aligned schedule (above the fused router's size) read x quantized once, so
        the norm before may write that quantization (backend/fp8_act.py) for them and the shared MLP's linears;
        the direct schedule quantizes its few rows on load."""
        return (self.quant is not None and self.quant.scheme in FP8_ACT and num_tokens > fused_router_max_tokens()
                and not use_direct(num_tokens, self.spec.router.top_k))

    def forward_hidden(self, x, gate_weight, correction_bias=None, shared_experts=None):
        if not self.loaded or self.route_counters is None:
            raise BackendError("MoE forward before load_experts")
        act = None
        if isinstance(x, Fp8Act):  # quantized by the norm (takes_fp8_act): the router reads x, the GEMMs act
            if not self.takes_fp8_act(x.rows):
                raise BackendError(f"MoE forward_hidden: Fp8Act input at {x.rows} tokens, where this op does not "
                                   "take one (takes_fp8_act)")
            act, x = x, x.values()
        if x.shape[0] > fused_router_max_tokens():
            shared = self._start_shared(x, shared_experts, act)  # before the router: it overlaps the routing
            logits = self.router_logits(x, gate_weight)
            weights, ids = self.route_fn(logits, self.spec.router, correction_bias, None, None)
            return self._experts(x, weights, ids, shared_experts, shared, act)
        # the fused router is one short launch: nothing for a side stream to overlap, the shared MLP runs inline
        x = x.contiguous()  # no-op for the model's hidden states
        weights, ids = gate_route(x, gate_weight, self.spec.router, correction_bias, self.route_counters)
        return self._experts(x, weights, ids, shared_experts)

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        if not self.loaded:
            raise BackendError("MoE forward before load_experts")
        shared = self._start_shared(x, shared_experts)
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        return self._experts(x, weights, ids, shared_experts, shared)

    def _folds_shared(self, x: torch.Tensor, top_k: int, shared_experts) -> bool:
        """Whether this batch runs the shared experts inside the grouped GEMMs: the direct schedule folds dense or
        quantized ones; the aligned one folds quantized ones in batches of up to DEEPINFER_MOE_FOLD_SHARED_ALIGNED
        tokens (decode sizes: at prefill sizes the dense shared MLP runs cuBLAS's GEMMs, faster there)."""
        if shared_experts is None:
            return False
        if use_direct(x.shape[0], top_k):
            return self.shared_w is not None or self.quant_shared is not None
        return self.quant_shared is not None and x.shape[0] <= envs.MOE_FOLD_SHARED_ALIGNED.get()

    def _start_shared(self, x: torch.Tensor, shared_experts, act: Fp8Act | None = None):
        """(shared output, join) with the dense shared MLP queued on the side stream (aligned mode only),
        or None: run inline by _experts (no CUDA stream, turned off) or folded into the direct GEMMs. act: x's
        quantization (the MLP's linears read it)."""
        if shared_experts is None or use_direct(x.shape[0], self.spec.router.top_k):
            return None  # direct mode folds it in, or its fused combine reads it mid-GEMM: no overlap there
        if self._folds_shared(x, self.spec.router.top_k, shared_experts):
            return None  # the aligned GEMMs run it
        if self.side_stream is None or not x.is_cuda or not envs.MOE_SHARED_STREAM.get():
            return None
        main, side = torch.cuda.current_stream(x.device), self.side_stream
        side.wait_stream(main)  # x is ready
        with torch.cuda.stream(side):
            out = shared_experts(x if act is None else act)
        return out, lambda: main.wait_stream(side)

    def _experts(self, x, weights, ids, shared_experts, shared=None, act: Fp8Act | None = None):
        """Routed experts (+ shared): direct with the shared MLP folded in, or aligned with its add fused. act:
        x's W8A8 quantization, made by the norm (the aligned GEMMs and the shared MLP read it)."""
        direct = use_direct(x.shape[0], ids.shape[1])
        x_quant = None if act is None else (act.q, act.s)
        if self._folds_shared(x, ids.shape[1], shared_experts):
            if self.quant_shared is not None:
                return fused_moe(x, topk_weights=weights, topk_ids=ids, align=self.align_fn, direct=direct,
                                 counters=self.counters, x_quant=x_quant, **self._gemm_weights(with_shared=True))
            return fused_moe(x, topk_weights=weights, topk_ids=ids, shared_w=self.shared_w, direct=True,
                             counters=self.counters, **self._gemm_weights())
        join = None
        if shared is not None:
            shared_out, join = shared
        else:
            shared_out = shared_experts(x if act is None else act) if shared_experts is not None else None
        return fused_moe(x, topk_weights=weights, topk_ids=ids, align=self.align_fn, shared_out=shared_out,
                         direct=direct, counters=self.counters, before_combine=join, x_quant=x_quant,
                         **self._gemm_weights())
