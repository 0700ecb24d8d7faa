"""The backend contract, and the one module a backend author imports from.

    from deepinfer.backend import hookimpl, Backend, BackendCaps, BackendInfo, NativeOps, MLASpec

A backend is a plugin (entry-point group `deepinfer.backends`) whose `hookimpl`
`deepinfer_register_backends(register)` registers a `BackendInfo`; its class subclasses
`NativeOps` (every op in torch, the oracle) and `Backend`, and overrides what it accelerates.
docs/backend-plugins.md walks through tests/plugins/toy_backend/. Everything a backend needs is
exported here; the submodules are the contract's own layout:

- base.py (Backend), caps.py (BackendCaps, FeatureRequest), specs.py (op specs),
  layer_ops.py (LinearMethod and the whole-layer op ABCs), op_support.py (OpSpec, OP_NAMES),
- forward_batch.py, kv_spec.py, kv_caches.py (KVLayout, KVCaches): what ops read,
- communicator.py (collectives; dist_communicator.py over torch.distributed), graph_runner.py (decode graphs),
  mtp_graph_runner.py (the speculative MTP drafter's graphs, over a decode runner's graph API),
- hookspecs.py + registry.py (pluggy), native/ (torch-native ops).
"""

from deepinfer.backend.base import Backend
from deepinfer.backend.caps import BackendCaps, FeatureRequest, dtype_name
from deepinfer.backend.communicator import (
    COLLECTIVE_OPS,
    PROCESS_GROUP_NAMES,
    Communicator,
    SingleProcessCommunicator,
)
from deepinfer.backend.dist_communicator import TorchDistributedCommunicator
from deepinfer.backend.forward_batch import DECODE_ROWS, TOKEN_REQUESTS, ForwardBatch, token_slots, token_slots_host
from deepinfer.backend.fp8_act import ROW_ALIGN, Fp8Act, empty_fp8_act, fp8_act_reference, padded_rows
from deepinfer.backend.graph_runner import DecodeGraphRunner, GraphRunner, StaticInputs, default_buckets
from deepinfer.backend.hookspecs import ENTRY_POINT_GROUP, BackendInfo, hookimpl
from deepinfer.backend.kv_caches import KVCaches, KVLayout, KVPart
from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.backend.layer_ops import (
    LinearMethod,
    MLAAttentionOp,
    MLAPrologWeights,
    MoEOp,
    V4AttentionOp,
)
from deepinfer.backend.mtp_graph_runner import MTPGraphRunner, argmax_confidence, mtp_draft_logits

# last: the native ops import the modules above
from deepinfer.backend.native import NativeOps
from deepinfer.backend.native.host_memory import host_memory_info
from deepinfer.backend.native.linear import dequant_fp8_block
from deepinfer.backend.native.mla_attention import NativeMLAAttention, gather_context, write_latent
from deepinfer.backend.native.moe import NativeMoE
from deepinfer.backend.native.quant_fp4 import FP4_GROUP, as_fp4_scale, as_packed_fp4, dequant_fp4, quantize_fp4
from deepinfer.backend.native.quant_fp8 import quantize_act_fp8, quantize_weight_fp8_block, w8a8_block_linear_ref
from deepinfer.backend.native.quant_int4 import (
    Int4Weight,
    act_order_permutation,
    dequant_int4,
    dequant_int4_rows,
    int4_expert_rows,
    int4_expert_values,
    int4_values,
    pack_int4_rows,
    unpack_int4_rows,
)
from deepinfer.backend.native.routing import route, validate_router
from deepinfer.backend.native.v4_attention import NativeV4Attention
from deepinfer.backend.op_support import LINEAR_SCHEMES, OP_NAMES, OpSpec
from deepinfer.backend.quantized_experts import (
    FP8_EXPERT_SCHEMES,
    INT4_ACT_ORDER,
    INT4_EXPERT_GROUPS,
    INT4_EXPERT_SCHEMES,
    MOE_QUANT_SCHEMES,
    QuantizedExperts,
)
from deepinfer.backend.specs import MLASpec, MoESpec, RouterSpec, V4AttentionSpec
from deepinfer.errors import BackendError, UnsupportedOpError

__all__ = [
    "Backend", "BackendCaps", "DECODE_ROWS", "BackendError", "BackendInfo", "COLLECTIVE_OPS", "Communicator", "DecodeGraphRunner",
    "ENTRY_POINT_GROUP", "FeatureRequest", "ForwardBatch", "GraphRunner", "KVCacheSpec", "KVCaches", "KVLayout",
    "KVPart", "LINEAR_SCHEMES", "LinearMethod", "MLAAttentionOp", "MLAPrologWeights", "MLASpec", "MOE_QUANT_SCHEMES", "FP8_EXPERT_SCHEMES", "INT4_ACT_ORDER", "INT4_EXPERT_GROUPS", "INT4_EXPERT_SCHEMES", "MoEOp", "MoESpec", "QuantizedExperts",
    "NativeMLAAttention",
    "NativeMoE", "NativeOps", "NativeV4Attention", "OP_NAMES", "OpSpec", "PROCESS_GROUP_NAMES", "RouterSpec",
    "SingleProcessCommunicator", "StaticInputs", "TOKEN_REQUESTS", "TorchDistributedCommunicator", "UnsupportedOpError", "V4AttentionOp",
    "V4AttentionSpec", "default_buckets", "dtype_name", "MTPGraphRunner", "argmax_confidence", "mtp_draft_logits",
    "gather_context", "hookimpl", "host_memory_info", "route", "token_slots", "token_slots_host", "validate_router", "write_latent",
    # quantization (docs/quantization.md): the packed int4 record and the reference quantizers
    "FP4_GROUP", "Int4Weight", "as_fp4_scale", "as_packed_fp4", "dequant_fp4", "dequant_fp8_block", "dequant_int4", "dequant_int4_rows", "int4_expert_rows", "int4_values", "quantize_act_fp8", "quantize_fp4",
    "act_order_permutation", "int4_expert_values", "pack_int4_rows", "unpack_int4_rows",
    "quantize_weight_fp8_block", "w8a8_block_linear_ref",
    # activations quantized by the norm before their fp8 W8A8 consumers (backend/fp8_act.py)
    "Fp8Act", "ROW_ALIGN", "empty_fp8_act", "fp8_act_reference", "padded_rows",
]
