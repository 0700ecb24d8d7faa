"""What a conformance case is, and the input helpers every case family shares.

A case builds its inputs on the CPU from a seeded generator (so every device sees the same
numbers) and runs one op through any object with the Backend op methods; the runner moves the
inputs to the backend's device, asks `Backend.supports(case.op_spec(dtype))` first, and compares
the backend with `NativeOps`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from deepinfer.backend import OpSpec, RouterSpec

Inputs = dict[str, Any]
FP32 = (torch.float32,)


@dataclass(frozen=True)
class Case:
    op: str  # OP_NAMES entry
    name: str
    make: Callable[[torch.Generator, torch.dtype], Inputs]  # CPU tensors
    run: Callable[[Any, Inputs], tuple[torch.Tensor, ...]]  # (backend-like ops, inputs) -> outputs
    compare: str = "close"  # close (integer outputs: exact) | exact | route | bitwise (same bits, -inf and NaN too)
    kind: str = "elementwise"  # elementwise | layer (looser low-precision tolerances)
    dtypes: tuple[torch.dtype, ...] | None = None  # fixed dtypes (route: fp32 logits); None = the run's
    spec: Any = None  # the layer spec the op is built from (MLASpec, MoESpec, RouterSpec, ...)
    options: tuple[tuple[str, Any], ...] = ()  # per-call variants (e.g. ("limit", 1.5): a clamped SwiGLU)

    def op_spec(self, dtype: torch.dtype) -> OpSpec:
        """What this case asks of a backend, for Backend.supports / op_impl."""
        return OpSpec(self.op, dtype, self.spec, self.options)


def randn(g: torch.Generator, *shape: int, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def router_specs(real: bool) -> dict[str, RouterSpec]:
    e2, e3 = (64, 256) if real else (16, 32)
    return {
        "v2-lite softmax greedy": RouterSpec(e2, 6 if real else 4, "softmax", "greedy", routed_scaling_factor=1.0),
        "v2 softmax group_limited_greedy": RouterSpec(e2, 6 if real else 4, "softmax", "group_limited_greedy",
                                                      n_group=8 if real else 4, topk_group=3 if real else 2,
                                                      routed_scaling_factor=16.0),
        "v3 sigmoid noaux_tc": RouterSpec(e3, 8 if real else 4, "sigmoid", "noaux_tc", n_group=8, topk_group=4,
                                          norm_topk_prob=True, routed_scaling_factor=2.5),
        "v4 sqrtsoftplus noaux_tc": RouterSpec(e3, 6 if real else 4, "sqrtsoftplus", "noaux_tc",
                                               norm_topk_prob=True, routed_scaling_factor=1.5),
        "v4 sqrtsoftplus hash": RouterSpec(e3, 6 if real else 4, "sqrtsoftplus", "hash", norm_topk_prob=True,
                                           routed_scaling_factor=1.5),
    }


def router_inputs(g: torch.Generator, spec: RouterSpec, t: int, vocab: int = 64) -> Inputs:
    inputs: Inputs = {"logits": randn(g, t, spec.num_experts, scale=2.0), "bias": None, "tokens": None, "tid2eid": None}
    if spec.topk_method == "noaux_tc":
        inputs["bias"] = randn(g, spec.num_experts, scale=0.1)
    if spec.topk_method == "hash":
        inputs["tokens"] = torch.randint(0, vocab, (t,), generator=g)
        inputs["tid2eid"] = torch.stack([torch.randperm(spec.num_experts, generator=g)[: spec.top_k]
                                         for _ in range(vocab)])
    return inputs
