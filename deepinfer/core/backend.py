"""The backend contract: what the core and the models may ask of a device.

A backend is a `Backend` subclass plus a frozen `BackendCaps`. Every op below
has a torch-native implementation in `deepinfer.core.native` (the oracle of the
conformance suite); the `cpu` backend uses those, other backends override the
ops they accelerate. Op boundaries follow what vendors fuse: whole MLA
attention, whole MoE (route -> experts -> combine), linear per quant scheme,
and small fused ops.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from deepinfer.core.layer_ops import (  # re-exported: the op types are part of this contract
    LinearMethod,
    MLAAttentionOp,
    MLASpec,
    MoEOp,
    MoESpec,
    RouterSpec,
    V4AttentionOp,
    V4AttentionSpec,
)

__all__ = [
    "Backend", "BackendCaps", "BackendInfo", "FeatureRequest", "LinearMethod", "MLAAttentionOp", "MLASpec",
    "MoEOp", "MoESpec", "RouterSpec", "V4AttentionOp", "V4AttentionSpec",
]


@dataclass(frozen=True)
class BackendCaps:
    """What a backend can do. Defaults are the cautious answer."""

    device_type: str = "cpu"
    dtypes: tuple[torch.dtype, ...] = (torch.float32,)
    kv_block_sizes: tuple[int, ...] = (16,)
    quant_schemes: tuple[str, ...] = ("none",)  # "none", "fp8_block" (128x128 e4m3 + scale_inv)
    model_types: tuple[str, ...] = ()  # model_type values whose ops are all implemented
    batch_invariant: bool = False
    graph_capture: bool = False
    fp8: bool = False
    fp4: bool = False
    max_tensor_parallel_size: int = 1
    collectives: tuple[str, ...] = ()

    def unsupported(self, req: "FeatureRequest") -> list[str]:
        """Reasons this backend cannot serve `req`; empty means it can."""
        reasons: list[str] = []
        if req.dtype is not None and req.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            reasons.append(f"dtype {str(req.dtype).removeprefix('torch.')} not supported (supported: {names})")
        if req.quantization is not None and req.quantization not in self.quant_schemes:
            reasons.append(f"quantization {req.quantization!r} not supported (supported: {', '.join(self.quant_schemes)})")
        if req.model_type is not None and self.model_types and req.model_type not in self.model_types:
            reasons.append(f"model_type {req.model_type!r} not supported (supported: {', '.join(self.model_types)})")
        if req.tensor_parallel_size > self.max_tensor_parallel_size:
            reasons.append(
                f"tensor_parallel_size={req.tensor_parallel_size} exceeds this backend's maximum "
                f"of {self.max_tensor_parallel_size}"
            )
        if req.batch_invariant and not self.batch_invariant:
            reasons.append("batch-invariant inference (DEEPINFER_BATCH_INVARIANT=1) is not supported")
        if req.require_graphs and not self.graph_capture:
            reasons.append("graph capture is not supported")
        if req.kv_block_size is not None and req.kv_block_size not in self.kv_block_sizes:
            reasons.append(f"KV block size {req.kv_block_size} not supported (supported: {self.kv_block_sizes})")
        return reasons


@dataclass(frozen=True)
class FeatureRequest:
    """What the engine is about to ask of a backend, checked at start-up."""

    dtype: torch.dtype | None = None
    quantization: str | None = None
    model_type: str | None = None
    tensor_parallel_size: int = 1
    batch_invariant: bool = False
    require_graphs: bool = False
    kv_block_size: int | None = None


# ---------------------------------------------------------------- op specs



class Backend(ABC):
    """A device. One instance per worker, resolved once at start-up.

    Subclasses of `deepinfer.core.native.NativeOps` get every op below in torch;
    a backend overrides what it accelerates and reports it in `op_coverage`.
    """

    name: ClassVar[str]

    @property
    @abstractmethod
    def caps(self) -> BackendCaps: ...

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    # small fused ops
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    @abstractmethod
    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (rms_norm(x + residual), x + residual)."""

    @abstractmethod
    def rotary_embedding(
        self,
        positions: torch.Tensor,  # [T] int64
        q: torch.Tensor,  # [T, Hq, R]
        k: torch.Tensor,  # [T, Hk, R]
        cos_sin_cache: torch.Tensor,  # [max_pos, R] fp32: cos in [:R/2], sin in [R/2:]
        interleaved: bool,  # True: pairs (2i, 2i+1) rotate (DeepSeek); False: halves
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2I] -> silu(x[:, :I]) * x[:, I:]."""

    @abstractmethod
    def kv_cache_write(self, cache: torch.Tensor, slot_mapping: torch.Tensor, values: torch.Tensor) -> None:
        """cache.view(-1, *entry)[slot] = values[i] for slot >= 0; slot -1 is skipped."""

    @abstractmethod
    def route(
        self,
        router_logits: torch.Tensor,  # [T, E] fp32
        spec: RouterSpec,
        correction_bias: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        tid2eid: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk_weights [T, k] fp32, final, scaling applied; topk_ids [T, k] int64)."""

    # layer ops
    @abstractmethod
    def linear_method(self, scheme: str) -> LinearMethod: ...

    @abstractmethod
    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp: ...

    @abstractmethod
    def make_moe(self, spec: MoESpec) -> MoEOp: ...

    def make_v4_attention(self, spec: V4AttentionSpec) -> V4AttentionOp:
        """DeepSeek-V4 attention layer; the torch-native one unless a backend overrides it."""
        from deepinfer.core.native.v4_attention import NativeV4Attention

        return NativeV4Attention(spec)

    # device services
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device memory the KV cache may use."""
        raise NotImplementedError(f"backend {self.name!r} does not report memory")

    def synchronize(self) -> None:
        return None

    def op_coverage(self) -> dict[str, str]:
        """op name -> how this backend runs it ("native", "triton", "cuda", ...)."""
        return {}


@dataclass
class BackendInfo:
    """What a plugin registers: a name, a probe that never initialises a device runtime, and a lazy class path."""

    name: str
    backend_class: str  # "package.module:ClassName", imported only when selected
    probe: "object"  # Callable[[], list[str]]: reasons it is unavailable here; [] = available
    device_type: str = "cpu"  # what --device value (besides the name) selects it: cpu | cuda | npu
    priority: int = 0  # `auto` takes the available backend with the highest priority
    description: str = ""
    plugin: str = field(default="", compare=False)
