"""What the ascend backend can do, per chip: the caps the engine checks at start-up.

- dtypes: bf16 and fp16. fp32 is refused: npu_fused_infer_attention_score, npu_interleave_rope and
  npu_kv_rmsnorm_rope_cache take only fp16 / bf16 (their docs). 310P has no bf16 and no MLA path.
- KV block sizes: 128 first (the paged attention docs recommend it), then 16 / 64 (MLA paged decode takes
  multiples of 16 up to 1024).
- quant schemes: "none"; "fp8_block" is dequantized to the compute dtype at load on every chip (910B / A3
  have no fp8 matmul; no torch_npu doc we read gives the 950's npu_quant_matmul call for fp8 inputs with
  128x128 block scales, docs/ascend.md). "int4_awq" / "int4_gptq" on A2 / A3 only: npu_weight_quant_batchmatmul
  takes int32-carried int4 weights with per-group antiquant there (its docs' product table; the 950 is not in
  the torch_npu docs we read for it). GPTQ act-order checkpoints are refused at load (int4_linear.py).
  "int8_w8a8" (msModelSlim W8A8_DYNAMIC) on A2 / A3 only: npu_dynamic_quant (per-token int8) + npu_quant_matmul
  (int8 x int8, per-channel weight scale, per-token scale, fp16 / bf16 out) are documented there (int8_linear.py).
  fp8_w8a8 is not claimed.
- batch_invariant: refused (no kernel here has a fixed reduction order across batch shapes).
- graph_capture: decode-only ACL graphs per batch bucket on A2 / A3 (graph_runner.py): the fused attention's
  host actual_seq_lengths_kv are updated before each replay (graph_task_group_begin / _end at capture,
  graph_task_update_begin / _end per step, graph_tasks.py), which the docs list for A2 / A3 only, from the
  torch_npu releases our docs describe (>= 2.7.1). Off on the 950 (not in those docs' product tables).
  Models whose layers fall back to native MLA / MoE or to a non-gating router run eagerly (the runner
  refuses every batch and logs why).
- max tensor parallel size 1: the HCCL communicator exists, the engine does not launch one process per NPU yet.
"""

from __future__ import annotations

import torch

from deepinfer.backend import BackendCaps
from deepinfer.errors import BackendError

SUPPORTED_CHIPS = ("a2", "a3", "950")
GRAPH_CHIPS = ("a2", "a3")  # graph_task_update_begin / _end docs: Atlas A2 / A3 products
GRAPH_TASK_UPDATE_SINCE = (2, 7, 1)  # the op-plugin docs we wrote against document it; older: not checked
KV_BLOCK_SIZES = (128, 16, 64)
INT4_CHIPS = ("a2", "a3")  # npu_weight_quant_batchmatmul docs: int32-carried int4, per-group, Atlas A2 / A3
INT4_SCHEMES = ("int4_awq", "int4_gptq")
INT8_CHIPS = ("a2", "a3")  # npu_quant_matmul docs: int8 x int8 with pertoken_scale, Atlas A2 / A3
INT8_SCHEMES = ("int8_w8a8",)
BATCH_INVARIANT_REASON = "no ascend kernel here has a batch-independent reduction order (nothing proves one)"


def ascend_caps(chip: str, on_cpu: bool, version: tuple[int, int, int] = (0, 0, 0)) -> BackendCaps:
    if chip not in SUPPORTED_CHIPS:
        raise BackendError(f"Ascend chip family {chip!r} is not supported (supported: {', '.join(SUPPORTED_CHIPS)}; "
                           "310P lacks bf16 and the MLA attention modes)")
    return BackendCaps(
        device_type="cpu" if on_cpu else "npu",
        dtypes=(torch.bfloat16, torch.float16),
        kv_block_sizes=KV_BLOCK_SIZES,
        quant_schemes=("none", "fp8_block", *(INT4_SCHEMES if chip in INT4_CHIPS else ()),
                       *(INT8_SCHEMES if chip in INT8_CHIPS else ())),
        model_types=("deepseek_v2", "deepseek_v3"),
        batch_invariant=False,
        graph_capture=chip in GRAPH_CHIPS and version >= GRAPH_TASK_UPDATE_SINCE,
        max_tensor_parallel_size=1,
    )
