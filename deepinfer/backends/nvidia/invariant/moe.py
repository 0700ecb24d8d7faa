"""`InvariantMoE`: the routed experts on one path for every batch size (batch-invariant mode).

Which path: the expert-aligned grouped GEMMs (moe_gemm.aligned_gemm) with BLOCK_M 64 (16 under the
interpreter), one K split per weight, whatever the token count; the tile (BLOCK_M 16 at a few pairs, 128 at
prefill sizes) follows the token count only where tile_choice.check_moe found, at load on this device, that it
gives the fixed tile's bits. The default op switches between
the direct mode and the aligned mode and picks BLOCK_M and the tile from the batch; each choice is fine on its
own but gives a token different bits in different batches. Here:

- router: the fp32 gate split into three bf16 parts (router.split_gate, once), one invariant GEMM of 3N columns
  (router_parts), and the per-token top-k that sums the parts as it reads them (router.route_parts): two
  launches. fp32 activations (tests, fp32 models) take the fp32 invariant GEMM and moe_routing.route;
- layout: moe_align.align, a counting sort by expert in token order (one launch at small batches, two above);
- experts: gate_up + SiLU-and-mul, then down * routing weight (fp32), each row of a pair one fixed sum;
- shared experts: when the model offers their dense weights (fuse_shared_experts), they run as experts E.. of
  the same two GEMMs (every token, weight 1.0), so the layer is five launches (router, top-k, align, two GEMMs)
  plus the combine; else the model's shared MLP (invariant GEMMs) runs and its output is added in the combine;
- combine: a token's slots summed in slot order in fp32, rounded once (fused_moe.combine, no atomics).
"""

from __future__ import annotations

import torch

from deepinfer.backend import MoESpec, NativeMoE
from deepinfer.backends.nvidia.fused_moe import combine
from deepinfer.backends.nvidia.invariant.counters import tile_counters
from deepinfer.backends.nvidia.invariant.gemm import interpreting, linear
from deepinfer.backends.nvidia.invariant.moe_align import align
from deepinfer.backends.nvidia.invariant.moe_gemm import aligned_gemm
from deepinfer.backends.nvidia.invariant.router import route_parts, router_parts, split_gate
from deepinfer.backends.nvidia.invariant.tile_choice import check_moe, moe_choice
from deepinfer.backends.nvidia.moe import check_shared_mlp, triton_moe_unsupported
from deepinfer.backends.nvidia.moe_routing import route
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
    slice_k: int | None = None  # the grouped GEMMs' K slice (None: moe_gemm's); benchmarks compare others
    tile: dict | None = None  # the grouped GEMMs' tiles (None: moe_gemm.tile's); benchmarks compare others
    block_m_override: int | None = None  # pairs per expert tile (None: block_m()); benchmarks compare others
    _tiles_key: tuple = ()  # the experts' shapes and dtype: tile_choice's key (set at load)

    def __init__(self, spec: MoESpec):
        reasons = triton_moe_unsupported(spec)
        if reasons:
            raise BackendError("the batch-invariant MoE does not implement: " + ", ".join(reasons))
        super().__init__(spec, route_fn=_route)
        self._gate_split: tuple[int, torch.Tensor] | None = None  # (the fp32 gate's data_ptr, its split)
        self.shared_w: tuple[torch.Tensor, torch.Tensor] | None = None  # (gate_up [2SI, D], down [D, SI])

    def load_experts(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().load_experts(w13, w2)
        tile_counters(w13.device, 0)  # at load, never first inside a graph capture
        self._tiles_key = (*w13.shape, *w2.shape, w13.dtype)
        check_moe(self._tiles_key, self._tile_probe, w13.device)

    def _tile_probe(self, num_tokens: int, bm: int | None, tile: dict | None) -> torch.Tensor:
        """The experts over the first num_tokens of a fixed random batch with fixed random routing (tile_choice)."""
        E, _, D = self.w13.shape
        k = self.spec.router.top_k
        g = torch.Generator(device=self.w13.device).manual_seed(0)
        n = num_tokens
        x = torch.randn(n, D, device=self.w13.device, generator=g).to(self.w13.dtype)
        ids = torch.rand(n, E, device=self.w13.device, generator=g).topk(k, dim=1).indices.to(torch.int32)
        weights = torch.rand(n, k, device=self.w13.device, generator=g)
        return self._experts(x, weights, ids, None, skip_unrouted=False, choice=(bm, tile))

    def fuse_shared_experts(self, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
        """Keep the shared MLP's dense weights: it then runs as experts E.. inside the grouped GEMMs."""
        check_shared_mlp(self.spec, gate_up, down, self.w13)
        if gate_up.dtype != self.w13.dtype or down.dtype != self.w13.dtype:
            return False  # the kernel reads one dtype; the model's MLP (invariant GEMMs) runs instead
        self.shared_w = (gate_up.contiguous(), down.contiguous())
        return True

    def _split(self, gate_weight: torch.Tensor) -> torch.Tensor:
        # the gate is a loaded weight: split once (the first forward, before any graph capture), reused
        if self._gate_split is None or self._gate_split[0] != gate_weight.data_ptr():
            self._gate_split = (gate_weight.data_ptr(), split_gate(gate_weight))
        return self._gate_split[1]

    def router_logits(self, x: torch.Tensor, gate_weight: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.bfloat16 and gate_weight.dtype == torch.float32:
            parts = router_parts(x, self._split(gate_weight))
            n = parts.shape[1] // 3
            return (parts[:, :n] + parts[:, n: 2 * n]) + parts[:, 2 * n:]  # as route_parts sums them
        return linear(x, gate_weight, out_dtype=torch.float32)

    def forward_hidden(self, x, gate_weight, correction_bias=None, shared_experts=None):
        if not self.loaded:
            raise BackendError("MoE forward before load_experts")
        if x.dtype == torch.bfloat16 and gate_weight.dtype == torch.float32:
            weights, ids = route_parts(router_parts(x, self._split(gate_weight)), self.spec.router, correction_bias)
        else:
            weights, ids = _route(linear(x, gate_weight, out_dtype=torch.float32), self.spec.router, correction_bias)
        return self._experts(x, weights, ids, shared_experts, skip_unrouted=False)

    def forward(self, x, router_logits, correction_bias=None, token_ids=None, tid2eid=None, shared_experts=None):
        if not self.loaded:
            raise BackendError("MoE forward before load_experts")
        weights, ids = self.route_fn(router_logits, self.spec.router, correction_bias, token_ids, tid2eid)
        return self._experts(x, weights, ids, shared_experts, skip_unrouted=False)

    def experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Expert parallelism's entry (no shared experts): a -1 id (another rank's expert) is left out of the
        layout and its zeroed slot adds nothing; the other pairs' rows are computed as always."""
        if not self.loaded:
            raise BackendError("MoE experts before load_experts")
        return self._experts(x, topk_weights, topk_ids, None, skip_unrouted=True)

    def _experts(self, x, topk_weights, topk_ids, shared_experts, skip_unrouted: bool,
                 choice: tuple[int | None, dict | None] | None = None) -> torch.Tensor:
        T, D = x.shape
        E, two_i, _ = self.w13.shape
        k = topk_ids.shape[1]
        if T == 0:
            return torch.zeros_like(x)
        x = x.contiguous()
        fold = shared_experts is not None and self.shared_w is not None
        num_shared = self.shared_w[1].shape[1] // (two_i // 2) if fold else 0
        slots = k + num_shared
        bm, tile = choice or moe_choice(self._tiles_key, T, slots)
        bm = self.block_m_override or bm or block_m()
        tile = self.tile or tile
        al = align(topk_ids, E, num_shared, bm)
        n = T * slots
        act = torch.empty((n, two_i // 2), dtype=x.dtype, device=x.device)
        aligned_gemm(x, self.w13, act, al, bm, k, slots, slots, shared_w=self.shared_w[0] if fold else None,
                     dual=True, slice_override=self.slice_k, tile_override=tile)
        # every slot's row is written unless some pairs are left out (-1): then zeros, which the combine adds
        y = (torch.zeros if skip_unrouted else torch.empty)((n, D), dtype=torch.float32, device=x.device)
        aligned_gemm(act, self.w2, y, al, bm, k, slots, 1, shared_w=self.shared_w[1] if fold else None,
                     topk_weights=topk_weights.float().contiguous(), slice_override=self.slice_k,
                     tile_override=tile)
        shared_out = shared_experts(x) if shared_experts is not None and not fold else None
        return combine(y.view(T, slots, D), shared_out, x.dtype)
