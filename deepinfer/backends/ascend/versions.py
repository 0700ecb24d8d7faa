"""Which torch_npu release each operator call was written against, and the limits that differ by release.

Signatures are from Ascend/op-plugin's operator docs (docs/zh/custom_APIs/torch_npu on master @517f2e7,
2026-08, the docs of torch_npu 2.7.1 / 26.x releases; branches 7.1.0-7.3.0 compared where a limit moved).
None of it has run on an NPU. Where a documented limit differs by release, the code branches here,
on the torch_npu version: releases before 2.7.1 are treated as the 7.1.0 docs describe them
(conservative: an op that might fit is routed to our own kernel or to torch instead).
"""

from __future__ import annotations

from deepinfer.backend import RouterSpec

PINNED_TORCH_NPU = (2, 13, 0)  # requirements-ascend.txt
GENERAL_GATING_SINCE = (2, 7, 1)  # op-plugin 7.2.0 docs: any E <= 2048; 7.1.0 docs: E = 256, groups 8, k_group 4

# operator -> (the call as the backend makes it, the doc page, the release it was written against)
OPERATORS: dict[str, tuple[str, str]] = {
    "npu_rms_norm": ("npu_rms_norm(x, gamma, epsilon) -> (y, rstd)", "(beta)torch_npu-npu_rms_norm.md"),
    "npu_add_rms_norm": ("npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x)", "torch_npu-npu_add_rms_norm.md"),
    "npu_swiglu": ("npu_swiglu(x, dim=-1) -> Tensor", "(beta)torch_npu-npu_swiglu.md"),
    "npu_interleave_rope": ("npu_interleave_rope(x [B,N,S,64], cos, sin [B,1,S,64]) -> Tensor",
                            "torch_npu-npu_interleave_rope.md"),
    "npu_kv_rmsnorm_rope_cache": ("npu_kv_rmsnorm_rope_cache(kv [B,1,S,576], gamma, cos, sin, index, k_cache, "
                                  "ckv_cache, epsilon=, cache_mode='PA')", "torch_npu-npu_kv_rmsnorm_rope_cache.md"),
    "npu_fused_infer_attention_score": (
        "npu_fused_infer_attention_score(q, k, v, query_rope=, key_rope=, num_heads=, num_key_value_heads=, "
        "input_layout='BSND'|'TND', scale=, block_table=, block_size=, actual_seq_lengths=, "
        "actual_seq_lengths_kv=, sparse_mode=0|3, atten_mask=) -> (out, lse)",
        "torch_npu-npu_fused_infer_attention_score.md"),
    "npu_fused_infer_attention_score.out": (
        "npu_fused_infer_attention_score.out(q, k, v, workspace=, out=[out, lse], <as above>) (with "
        "_npu_fused_infer_attention_score_get_max_workspace(q, k, v, <as above>))",
        "torch_npu-npu-graph_task_group_begin.md (its example)"),
    "torch_npu.npu.graph_task_*": ("graph_task_group_begin(stream); graph_task_group_end(stream) -> handle; "
                                   "graph_task_update_begin(stream, handle); graph_task_update_end(stream)",
                                   "torch_npu-npu-graph_task_group_begin.md (+ _end, update_begin, update_end)"),
    "npu_mla_prolog_v3": ("npu_mla_prolog_v3(x [T,He], w_dq NZ [He,Hcq], w_uq_qr NZ [Hcq,N*192], w_uk [N,128,512], "
                          "w_dkv_kr NZ [He,576], gamma_cq, gamma_ckv, sin, cos [T,64], kv_cache, kr_cache, "
                          "cache_index=, rmsnorm_epsilon_cq=, rmsnorm_epsilon_ckv=, cache_mode='PA_BSND'|'TND') "
                          "-> (q_n, q_r, _, _, _)", "torch_npu-npu_mla_prolog_v3.md (26.0.0 limits; 7.3.0: beta)"),
    "npu_format_cast": ("npu_format_cast(w, 29) (FRACTAL_NZ, the prolog's weights)", "npu_mla_prolog_v3's example"),
    "npu_scatter_pa_kv_cache": ("npu_scatter_pa_kv_cache(latent [T,1,512], rope [T,1,64], latent_cache [nb,bs,1,512], "
                                "rope_cache [nb,bs,1,64], slots, cache_mode='Norm')",
                                "docs/context/torch_npu-npu_scatter_pa_kv_cache.md, 7.2.0 (its ND scenario 2)"),
    "npu_moe_gating_top_k": ("npu_moe_gating_top_k(x, k, bias=, k_group=, group_count=, group_select_mode=, "
                             "renorm=0, norm_type=0|1, routed_scaling_factor=, eps=) -> (y, idx, norm_out)",
                             "torch_npu-npu_moe_gating_top_k.md"),
    "npu_moe_init_routing_v2": ("npu_moe_init_routing_v2(x, expert_idx, active_num=-1, expert_num=E, "
                                "drop_pad_mode=0, expert_tokens_num_type=1, expert_tokens_num_flag=True, "
                                "quant_mode=-1, active_expert_range=[0, E], row_idx_type=0)",
                                "torch_npu-npu_moe_init_routing_v2.md"),
    "npu_grouped_matmul": ("npu_grouped_matmul([x], [w (E,K,N)], group_list=counts, group_type=0, "
                           "group_list_type=1, split_item=2) -> [y]", "torch_npu-npu_grouped_matmul.md"),
    "npu_moe_finalize_routing": ("npu_moe_finalize_routing(rows, None, None, None, scales, expanded_row_idx, "
                                 "expert_idx, drop_pad_mode=2) -> Tensor", "torch_npu-npu_moe_finalize_routing.md"),
}


def gating_top_k_reasons(spec: RouterSpec, version: tuple[int, int, int]) -> list[str]:
    """Why npu_moe_gating_top_k cannot compute this router (empty: it can), per its documented limits."""
    e, k, why = spec.num_experts, spec.top_k, []
    if spec.topk_method == "hash" or spec.scoring_func not in ("softmax", "sigmoid"):
        return [f"{spec.scoring_func} / {spec.topk_method} is not a norm_type of npu_moe_gating_top_k"]
    if spec.scoring_func == "sigmoid" and not spec.norm_topk_prob:
        why.append("the op always renormalises sigmoid weights (norm_topk_prob is false)")
    if spec.scoring_func == "softmax" and spec.norm_topk_prob:
        why.append("the op never renormalises softmax weights (norm_topk_prob is true)")
    groups = spec.n_group if spec.topk_method in ("group_limited_greedy", "noaux_tc") else 1
    k_group = spec.topk_group if groups > 1 else 1
    if version < GENERAL_GATING_SINCE:
        if (e, groups, k_group) != (256, 8, 4):
            why.append(f"torch_npu {'.'.join(map(str, version))} takes only 256 experts in 8 groups, k_group 4")
        return why
    width = e // groups if groups and e % groups == 0 else 0
    if e > 2048 or width <= 2 or -(-width // 32) * 32 * groups > 2048:
        why.append(f"{e} experts in {groups} groups: needs E <= 2048, E / group_count > 2, aligned width <= 2048")
    if not 1 <= k <= width * k_group:
        why.append(f"top_k {k} > {width} experts x k_group {k_group}")
    return why
