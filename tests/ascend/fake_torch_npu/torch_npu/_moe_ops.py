"""The MoE operators: gating top-k, init routing (permute), grouped matmul, finalize routing (unpermute)."""

from __future__ import annotations

import torch

from torch_npu._checks import FLOATS, dims, dtype_in, unused


def npu_moe_gating_top_k(x: torch.Tensor, k: int, *, bias: torch.Tensor | None = None, input_ids=None,
                         tid2eid=None, k_group: int = 1, group_count: int = 1, group_select_mode: int = 0,
                         renorm: int = 0, norm_type: int = 0, out_flag: bool = False,
                         routed_scaling_factor: float = 1.0, eps: float = 1e-20):
    """(y [T, k] x.dtype, expert_idx [T, k] int32, norm_out [T, E] fp32).

    norm_type 0 softmax / 1 sigmoid; bias added for selection only; groups scored by their max
    (group_select_mode 0) or top-2 sum (1), unselected groups -inf; y = the unbiased scores of the
    chosen experts, renormalised (sigmoid only) and times routed_scaling_factor. Ties: stable sort.
    """
    unused(input_ids=input_ids, tid2eid=tid2eid)
    dims("x", x, 2)
    dtype_in("x", x, FLOATS)
    e = x.shape[-1]
    if e > 2048:
        raise ValueError(f"npu_moe_gating_top_k: {e} experts > 2048")
    if group_count < 1 or e % group_count or e // group_count <= 2:
        raise ValueError(f"npu_moe_gating_top_k: group_count={group_count} must divide {e} experts into groups of > 2")
    if -(-(e // group_count) // 32) * 32 * group_count > 2048:
        raise ValueError("npu_moe_gating_top_k: 32-aligned group width x group_count > 2048")
    if not 1 <= k_group <= group_count or not 1 <= k <= e // group_count * k_group:
        raise ValueError(f"npu_moe_gating_top_k: k={k} / k_group={k_group} out of range")
    if renorm != 0:
        raise ValueError("npu_moe_gating_top_k: renorm supports only 0")
    if bias is not None and (bias.dtype != x.dtype or tuple(bias.shape) != (e,)):
        raise ValueError("npu_moe_gating_top_k: bias must be [E] in x's dtype")
    xf = x.float()
    scores = xf.softmax(-1) if norm_type == 0 else xf.sigmoid()
    choice = scores + bias.float() if bias is not None else scores.clone()
    t = x.shape[0]
    if group_count > 1:
        grouped = choice.view(t, group_count, -1)
        gscore = grouped.max(-1).values if group_select_mode == 0 else grouped.topk(2, dim=-1).values.sum(-1)
        gidx = torch.sort(gscore, dim=-1, descending=True, stable=True).indices[:, :k_group]
        keep = torch.zeros_like(gscore, dtype=torch.bool).scatter_(1, gidx, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :k]
    y = scores.gather(1, idx)
    if norm_type == 1:
        y = y / (y.sum(-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    return y.to(x.dtype), idx.to(torch.int32), (scores if out_flag else torch.empty(0))


def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *, scale=None, offset=None,
                            active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
                            drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                            active_expert_range: list[int] | None = None, row_idx_type: int = 0):
    """Dropless, unquantised: rows x[t] repeated per chosen expert and sorted by expert (stable).

    Returns (expanded_x [T*K, H], expanded_row_idx [T*K] int32, expert_tokens [E] int64, expanded_scale).
    row_idx_type 0 (gather): expanded_row_idx[t*K + k] = where (t, k) landed in expanded_x.
    expert_tokens_num_type 0: cumsum, 1: count.
    """
    unused(scale=scale, offset=offset)
    dims("x", x, 2)
    dims("expert_idx", expert_idx, 2)
    if expert_idx.dtype != torch.int32:
        raise TypeError("npu_moe_init_routing_v2: expert_idx must be int32")
    if drop_pad_mode != 0 or quant_mode != -1 or active_num not in (-1, 0) or row_idx_type != 0:
        raise NotImplementedError("fake torch_npu: only dropless, unquantised, gather-index routing is emulated")
    if expert_tokens_num_type not in (0, 1):
        raise NotImplementedError("fake torch_npu: expert_tokens_num_type 2 (key_value) is not emulated")
    lo, hi = active_expert_range or [0, expert_num]
    if (lo, hi) != (0, expert_num) or not 0 < expert_num <= 10240:
        raise NotImplementedError("fake torch_npu: only active_expert_range [0, expert_num] is emulated")
    t, k = expert_idx.shape
    flat = expert_idx.reshape(-1).long()
    if int(flat.min()) < 0 or int(flat.max()) >= expert_num:
        raise ValueError("npu_moe_init_routing_v2: expert id outside [0, expert_num)")
    sorted_row = torch.sort(flat, stable=True).indices  # sortedRowIdx: flat (t*K + k) positions by expert
    expanded_x = x[sorted_row // k]
    row_idx = torch.empty_like(sorted_row)
    row_idx[sorted_row] = torch.arange(t * k)
    counts = torch.bincount(flat, minlength=expert_num).to(torch.int64)
    tokens = counts.cumsum(0) if expert_tokens_num_type == 0 else counts
    return expanded_x, row_idx.to(torch.int32), (tokens if expert_tokens_num_flag else torch.empty(0)), \
        torch.empty(0, dtype=torch.float32)


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, bias=None, scale=None, offset=None,
                       antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                       group_list: torch.Tensor | None = None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item: int = 0, group_type: int | None = None,
                       group_list_type: int = 0, act_type: int = 0, output_dtype=None, tuning_config=None):
    """The m-axis grouped case (one x [M, K], one weight [E, K, N], group_type 0, split_item 2/3):
    rows of group g (sizes from group_list: cumsum for type 0, counts for type 1) times weight[g]."""
    unused(bias=bias, scale=scale, offset=offset, antiquant_scale=antiquant_scale,
           antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, activation_input=activation_input,
           activation_quant_scale=activation_quant_scale, activation_quant_offset=activation_quant_offset,
           output_dtype=output_dtype, tuning_config=tuning_config)
    if len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3) or act_type != 0:
        raise NotImplementedError("fake torch_npu: only one x, one [E, K, N] weight, group_type 0, split_item 2/3")
    a, w = x[0], weight[0]
    dims("x[0]", a, 2)
    dims("weight[0]", w, 3)
    dtype_in("x[0]", a, FLOATS)
    if w.dtype != a.dtype or w.shape[1] != a.shape[1]:
        raise ValueError(f"npu_grouped_matmul: x {tuple(a.shape)} {a.dtype} vs weight {tuple(w.shape)} {w.dtype}")
    if group_list is None or group_list.dtype != torch.int64 or group_list.shape[0] != w.shape[0]:
        raise ValueError("npu_grouped_matmul: group_list must be an int64 tensor with one entry per weight group")
    sizes = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    if group_list_type not in (0, 1) or int(sizes.min()) < 0 or int(sizes.sum()) > a.shape[0]:
        raise ValueError("npu_grouped_matmul: group_list does not split x's rows")
    out = torch.zeros((a.shape[0], w.shape[2]), dtype=a.dtype)
    start = 0
    for g, n in enumerate(sizes.tolist()):
        if n:
            out[start : start + n] = (a[start : start + n].float() @ w[g].float()).to(a.dtype)
        start += n
    return [out]


def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1, skip2, bias, scales: torch.Tensor,
                             expanded_src_to_dst_row: torch.Tensor, expert_for_source_row,
                             drop_pad_mode: int = 0) -> torch.Tensor:
    """out[i] = skip1 + skip2 + sum_k scales[i, k] * (rows[src_to_dst[idx(i, k)]] + bias[expert]) with
    idx = k * NUM_ROWS + i (drop_pad_mode 0, column order) or i * K + k (2, row order); fp32 sums."""
    if drop_pad_mode not in (0, 2):
        raise NotImplementedError("fake torch_npu: only the dropless modes 0 and 2 are emulated")
    if scales is None or scales.dtype != expanded_permuted_rows.dtype:
        raise ValueError("npu_moe_finalize_routing: scales must be given in the rows' dtype")
    if expanded_src_to_dst_row.dtype != torch.int32:
        raise TypeError("npu_moe_finalize_routing: expanded_src_to_dst_row must be int32")
    n, k = scales.shape
    idx = expanded_src_to_dst_row.long()
    order = idx.view(k, n).T if drop_pad_mode == 0 else idx.view(n, k)
    rows = expanded_permuted_rows.float()[order]  # [n, k, H]
    if bias is not None:
        rows = rows + bias.float()[expert_for_source_row.long()]
    out = (rows * scales.float()[..., None]).sum(1)
    for s in (skip1, skip2):
        if s is not None:
            out = out + s.float()
    return out.to(expanded_permuted_rows.dtype)
