"""Op names and `OpSpec`: the question "can this backend run this op, for these shapes and dtype?".

Like ggml's `supports_op`, `Backend.supports(OpSpec)` answers with the reasons it cannot (an
empty list: it can), and `Backend.op_impl(OpSpec)` names what runs it ("native", "triton", ...).
The conformance suite asks before it runs a case, and `deepinfer check --list-ops` renders
the answers of every installed backend over a fixed set of representative specs as the ops
matrix (docs/ops.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from deepinfer.backend.caps import dtype_name
from deepinfer.backend.communicator import COLLECTIVE_OPS

if TYPE_CHECKING:
    from deepinfer.backend.base import Backend

# Linear methods of the contract (docs/quantization.md); every one has a native method (native/linear.py):
# "none" (dense in the compute dtype); "fp8_block" (W8A16: e4m3 weights with 128x128 block scales,
# DeepSeek's release format, activations unquantized); "fp8_w8a8" (the same weights, activations quantized
# per token per 128 channels: DeepSeek / DeepGEMM's recipe); "int4_awq" / "int4_gptq" (weight-only int4,
# group 128, the checkpoints' own packing); "int8_w8a8" (msModelSlim's W8A8_DYNAMIC: int8 weights with
# per-output-channel scales, activations quantized per token to symmetric int8).
LINEAR_SCHEMES: tuple[str, ...] = ("none", "fp8_block", "fp8_w8a8", "int4_awq", "int4_gptq", "int8_w8a8")

SMALL_OPS: tuple[str, ...] = (
    "rms_norm",
    "add_rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "kv_cache_write",
    "route",
    "v4_rms_norm",
    "v4_rotary_embedding",
    # the norm / SiLU-and-mul that also write their output's fp8 quantization for W8A8 linears (backend/fp8_act.py)
    "rms_norm_fp8",
    "silu_and_mul_fp8",
)
LAYER_OPS: tuple[str, ...] = ("mla_attention", "moe", "v4_attention")
# Ops of the sampler rather than the model: structured output's grammar mask (Backend.apply_token_bitmask).
SAMPLING_OPS: tuple[str, ...] = ("apply_token_bitmask",)
# Ops of the runtime: one-token decode rows' inputs derived on the device (Backend.decode_rows_meta) and a draft
# with its confidence from the drafter's logits (Backend.draft_pick), both run inside the MTP graphs.
RUNTIME_OPS: tuple[str, ...] = ("decode_rows_meta", "draft_pick")

# Every op of the contract, as op_coverage(), OpSpec.op and the conformance suite name them.
OP_NAMES: tuple[str, ...] = (
    *SMALL_OPS,
    *(f"linear:{scheme}" for scheme in LINEAR_SCHEMES),
    *LAYER_OPS,
    *SAMPLING_OPS,
    *RUNTIME_OPS,
    *COLLECTIVE_OPS,
)


@dataclass(frozen=True)
class OpSpec:
    """One op as a model would ask for it.

    op: an OP_NAMES entry. dtype: the activations' dtype (None: any). spec: the layer spec the
    op is built from (MLASpec, MoESpec, RouterSpec for route, V4AttentionSpec) or None.
    options: per-call variants that change what runs, e.g. {"limit": 10.0} for a clamped SwiGLU.
    """

    op: str
    dtype: torch.dtype | None = None
    spec: Any = None
    options: tuple[tuple[str, Any], ...] = ()

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)

    def describe(self) -> str:
        parts = [self.op]
        if self.dtype is not None:
            parts.append(dtype_name(self.dtype))
        parts += [f"{k}={v}" for k, v in self.options]
        return " ".join(parts)


def contract_reasons(backend: "Backend", op: OpSpec) -> list[str]:
    """What the caps alone rule out: an unknown op, a dtype (of a model op) or a linear scheme the backend lacks."""
    if op.op not in OP_NAMES:
        return [f"unknown op {op.op!r} (known: {', '.join(OP_NAMES)})"]
    caps = backend.caps
    reasons = []
    # A sampling op's dtype is the logits' (fp32 in the engine: worker/model_runner.py upcasts them before the
    # sampler), a runtime op's its integers', not a compute dtype of the model: the caps' dtypes do not limit them.
    if op.dtype is not None and op.dtype not in caps.dtypes and op.op not in SAMPLING_OPS + RUNTIME_OPS:
        reasons.append(f"dtype {dtype_name(op.dtype)} is not in the backend's caps")
    if op.op.startswith("linear:"):
        scheme = op.op.partition(":")[2]
        if scheme not in caps.quant_schemes:
            reasons.append(f"quant scheme {scheme!r} is not in the backend's caps")
    return reasons
