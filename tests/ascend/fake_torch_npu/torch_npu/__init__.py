"""A TEST-ONLY CPU emulation of torch_npu (Ascend Extension for PyTorch). Not the real thing.

Each operator the DeepInfer ascend backend calls is emulated in plain torch on CPU tensors from its
documented semantics (Ascend/op-plugin docs/zh/custom_APIs/torch_npu, master @517f2e7, 2026-08):
the signature, the layouts, the dtypes it accepts, what it returns. Arguments the backend does not
use raise NotImplementedError naming them, and documented limits raise ValueError, so the fake
fails where the real operator would refuse. tests/ascend/test_ascend_fake_ops.py checks every
emulation against torch-native code.

`__deepinfer_fake__` tells the backend it runs on CPU tensors (there is no NPU device here).
"""

from __future__ import annotations

from torch_npu import _attention_ops, _int8_ops, _moe_ops, _norm_ops, _prolog_ops, _quant_ops, npu
from torch_npu._capture import CALLS, recorded

# every operator goes through `recorded`: one node of a graph capture, an argument update, or a plain call
npu_fused_infer_attention_score = recorded(_attention_ops.npu_fused_infer_attention_score)
npu_fused_infer_attention_score.out = recorded(_attention_ops.npu_fused_infer_attention_score_out)
_npu_fused_infer_attention_score_get_max_workspace = recorded(
    _attention_ops.npu_fused_infer_attention_score_get_max_workspace)
npu_interleave_rope = recorded(_attention_ops.npu_interleave_rope)
npu_kv_rmsnorm_rope_cache = recorded(_attention_ops.npu_kv_rmsnorm_rope_cache)
npu_grouped_matmul = recorded(_moe_ops.npu_grouped_matmul)
npu_moe_finalize_routing = recorded(_moe_ops.npu_moe_finalize_routing)
npu_moe_gating_top_k = recorded(_moe_ops.npu_moe_gating_top_k)
npu_moe_init_routing_v2 = recorded(_moe_ops.npu_moe_init_routing_v2)
npu_add_rms_norm = recorded(_norm_ops.npu_add_rms_norm)
npu_rms_norm = recorded(_norm_ops.npu_rms_norm)
npu_swiglu = recorded(_norm_ops.npu_swiglu)
npu_mla_prolog_v3 = recorded(_prolog_ops.npu_mla_prolog_v3)
npu_scatter_pa_kv_cache = recorded(_prolog_ops.npu_scatter_pa_kv_cache)
npu_weight_quant_batchmatmul = recorded(_quant_ops.npu_weight_quant_batchmatmul)
npu_convert_weight_to_int4pack = _quant_ops.npu_convert_weight_to_int4pack  # at load time only
npu_dynamic_quant = recorded(_int8_ops.npu_dynamic_quant)
npu_quant_matmul = recorded(_int8_ops.npu_quant_matmul)
npu_format_cast = _prolog_ops.npu_format_cast  # at load time only, never inside a capture

__deepinfer_fake__ = True
__version__ = "2.13.0"  # what requirements-ascend.txt pins

__all__ = [
    "CALLS", "npu", "npu_add_rms_norm", "npu_format_cast", "npu_fused_infer_attention_score", "npu_grouped_matmul",
    "npu_interleave_rope", "npu_kv_rmsnorm_rope_cache", "npu_mla_prolog_v3", "npu_moe_finalize_routing",
    "npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_rms_norm", "npu_scatter_pa_kv_cache", "npu_swiglu",
    "npu_convert_weight_to_int4pack", "npu_weight_quant_batchmatmul",
]
