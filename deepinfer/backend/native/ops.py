"""`NativeOps`: every abstract op of `Backend`, in plain torch.

A mixin: `class CPUBackend(NativeOps, Backend)`. Other backends inherit it too
and override what they accelerate, so an op they lack still runs (and their
`op_coverage` says which is which).
"""

from __future__ import annotations

import torch

from deepinfer.backend.fp8_act import Fp8Act, rms_norm_fp8_reference, silu_and_mul_fp8_reference
from deepinfer.backend.layer_ops import LinearMethod, MLAAttentionOp, MoEOp, V4AttentionOp
from deepinfer.backend.native import activation, kv_write, norm, rope, routing, v4_norm, v4_rope
from deepinfer.backend.native.linear import LINEAR_METHODS, native_linear_method
from deepinfer.backend.native.mla_attention import NativeMLAAttention
from deepinfer.backend.native.moe import NativeMoE
from deepinfer.backend.native.v4_attention import NativeV4Attention
from deepinfer.backend.op_support import LINEAR_SCHEMES, OP_NAMES
from deepinfer.backend.specs import MLASpec, MoESpec, RouterSpec, V4AttentionSpec

assert set(LINEAR_METHODS) == set(LINEAR_SCHEMES), "every linear scheme of the contract needs a native method"


class NativeOps:
    """Torch-native implementations of the Backend ops (the conformance oracle)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return norm.rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return norm.add_rms_norm(x, residual, weight, eps)

    def rms_norm_fp8(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[Fp8Act, torch.Tensor | None]:
        return rms_norm_fp8_reference(self, x, residual, weight, eps)

    def silu_and_mul_fp8(self, x: torch.Tensor, keep_values: bool = False) -> Fp8Act:
        return silu_and_mul_fp8_reference(self, x, keep_values)

    def rotary_embedding(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        interleaved: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope.rotary_embedding(positions, q, k, cos_sin_cache, interleaved)

    def silu_and_mul(self, x: torch.Tensor, limit: float | None = None) -> torch.Tensor:
        return activation.silu_and_mul(x, limit)

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

    def v4_rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        return v4_norm.v4_rms_norm(x, weight, eps)

    def v4_rotary_embedding(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return v4_rope.apply_v4_rope(x, cos, sin)

    def linear_method(self, scheme: str) -> LinearMethod:
        return native_linear_method(scheme)

    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp:
        return NativeMLAAttention(spec)

    def make_moe(self, spec: MoESpec) -> MoEOp:
        return NativeMoE(spec, route_fn=self.route)

    def make_v4_attention(self, spec: V4AttentionSpec) -> V4AttentionOp:
        return NativeV4Attention(spec)

    def op_coverage(self) -> dict[str, str]:
        return {name: "native" for name in OP_NAMES}

