"""`NativeOps`: every abstract op of `Backend`, in plain torch.

A mixin: `class CPUBackend(NativeOps, Backend)`. Other backends inherit it too
and override what they accelerate, so an op they lack still runs (and their
`op_coverage` says which is which).
"""

from __future__ import annotations

import torch

from deepinfer.core.backend import (
    LinearMethod,
    MLAAttentionOp,
    MLASpec,
    MoEOp,
    MoESpec,
    RouterSpec,
    V4AttentionOp,
    V4AttentionSpec,
)
from deepinfer.core.native import activation, kv_write, norm, rope, routing
from deepinfer.core.native.linear import LINEAR_METHODS, native_linear_method
from deepinfer.core.native.mla_attention import NativeMLAAttention
from deepinfer.core.native.moe import NativeMoE

# The op names used by op_coverage() and the conformance suite.
OP_NAMES: tuple[str, ...] = (
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "kv_cache_write",
    "route",
    *(f"linear:{scheme}" for scheme in LINEAR_METHODS),
    "mla_attention",
    "moe",
    "v4_attention",
)


class NativeOps:
    """Torch-native implementations of the Backend ops (the conformance oracle)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rotary_embedding(positions, q, k, cos_sin_cache, interleaved)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return activation.silu_and_mul(x)

    def kv_cache_write(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        kv_write.kv_cache_write(cache, slot_mapping, values)

    def route(
        self,
        router_logits: torch.Tensor,
        spec: RouterSpec,
        correction_bias: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return routing.route(router_logits, spec, correction_bias, token_ids, tid2eid)

    def linear_method(self, scheme: str) -> LinearMethod:
        return native_linear_method(scheme)

    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp:
        return NativeMLAAttention(spec)

    def make_moe(self, spec: MoESpec) -> MoEOp:
        return NativeMoE(spec, route_fn=self.route)

    def make_v4_attention(self, spec: V4AttentionSpec) -> V4AttentionOp:
        from deepinfer.core.native.v4_attention import NativeV4Attention

        return NativeV4Attention(spec)

    def op_coverage(self) -> dict[str, str]:
        return {name: "native" for name in OP_NAMES}
