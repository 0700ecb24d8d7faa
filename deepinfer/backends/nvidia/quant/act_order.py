"""GPTQ act-order routed experts, re-laid at load for the nvidia kernels: each expert's gate / up columns sorted by
group, and the activations gathered in the same order as the kernels load them (Marlin's approach to act-order).

Why. An act-order (desc_act) expert's gate and up projections put input channel k in group g_idx[e, k], a
permutation of k // G (QuantizedExperts.w13_g_idx). Read as stored, the grouped GEMM gathers a zero point and a
scale per (row, channel) instead of one per row and K tile, which costs ALU work and registers (BLOCK_K capped at 32,
fused_moe_config.GIDX_MAX_BLOCK_K); on an H100 one token's act-order experts took 113 us against 33 in contiguous
groups (docs/quantization.md). Sorting each expert's columns by group (a stable argsort of g_idx: column j of the
sorted weight is input channel perm[e, j], in group j // G) gives the contiguous-groups layout every other int4
weight has: the GEMMs read it as they read AWQ / GPTQ without act-order, and only A's columns are gathered through
perm (fused_moe_mainloop GIDX 2), which the expert's gate and up share. The scales and zero points stay as they are:
sorted column j's group is j // G, and group g's scales are the ones stored for group g.
"""

from __future__ import annotations

import torch

from deepinfer.backend import BackendError, QuantizedExperts, pack_int4_rows, unpack_int4_rows


def sort_act_order_columns(q: QuantizedExperts) -> tuple[QuantizedExperts, torch.Tensor]:
    """(the experts with w13's columns sorted by group and no w13_g_idx, perm int32 [E, D]: the input channel of
    each sorted column). Experts whose g_idx is already k // G keep their columns (perm = arange). BackendError
    where a group does not hold exactly G channels (GPTQ's act-order assigns G channels a group)."""
    g_idx = q.w13_g_idx
    if g_idx is None:
        raise BackendError("sort_act_order_columns: the experts carry no act-order g_idx")
    E, _, half = q.w13.shape
    D, G = 2 * half, q.group_size
    want = torch.arange(D, device=g_idx.device) // G
    perm = torch.argsort(g_idx.long(), dim=1, stable=True)
    if not torch.equal(torch.gather(g_idx.long(), 1, perm), want.expand(E, D)):
        raise BackendError(f"sort_act_order_columns: each act-order group must hold exactly {G} input channels")
    w13 = torch.empty_like(q.w13)
    for e in range(E):  # one expert at a time: the unpacked nibbles of a whole layer would be 2x its weights
        vals = unpack_int4_rows(q.w13[e]).index_select(1, perm[e].to(q.w13.device))
        w13[e] = pack_int4_rows(vals)
    sorted_q = QuantizedExperts(q.scheme, w13, q.w13_scale, q.w2, q.w2_scale, q.w13_zeros, q.w2_zeros, G, None)
    return sorted_q, perm.to(device=q.w13.device, dtype=torch.int32).contiguous()
