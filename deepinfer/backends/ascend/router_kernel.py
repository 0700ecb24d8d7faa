"""Softmax + greedy top-k routing (DeepSeek-V2-Lite's router) in Triton, for triton-ascend.

Used where npu_moe_gating_top_k cannot take the router (torch_npu before 2.7.1 accepts only 256
experts in 8 groups; softmax with norm_topk_prob is never renormalised by the op). One program per
token: load the row, softmax in fp32, k rounds of argmax (ties to the lowest index, as the reference)
masking each winner, optional renormalisation, routed scaling. Only tl.load / tl.store / max / sum /
exp / argmax / where: what both the regular triton and triton-ascend accept. CI runs it under
TRITON_INTERPRET=1 on the CPU; it has never been compiled for an NPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, scaling,
                         TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, RENORM: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < num_experts
    x = tl.load(logits_ptr + row * num_experts + cols, mask=valid, other=float("-inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.where(valid, tl.exp(x), 0.0)
    p = e / tl.sum(e, axis=0)
    # pass 1: the sum of the k winners (for renormalisation); pass 2: the same rounds, storing the results
    work = tl.where(valid, p, -1.0)
    total = 0.0
    for j in tl.static_range(TOP_K):
        total += tl.max(work, axis=0)
        work = tl.where(cols == tl.argmax(work, axis=0), -2.0, work)
    factor = scaling / (total + 1e-20) if RENORM else scaling
    work = tl.where(valid, p, -1.0)
    for j in tl.static_range(TOP_K):
        idx = tl.argmax(work, axis=0)
        tl.store(ids_ptr + row * TOP_K + j, idx.to(tl.int64))
        tl.store(weights_ptr + row * TOP_K + j, tl.max(work, axis=0) * factor)
        work = tl.where(cols == idx, -2.0, work)


def softmax_greedy_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
                        routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] fp32, ids [T, k] int64) of the softmax greedy router (the caller checks `kernel_reasons`)."""
    t, e = router_logits.shape
    logits = router_logits.float().contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int64, device=logits.device)
    if t:
        _softmax_topk_kernel[(t,)](logits, weights, ids, e, float(routed_scaling_factor), TOP_K=top_k,
                                   BLOCK_E=triton.next_power_of_2(e), RENORM=bool(norm_topk_prob))
    return weights, ids


def kernel_reasons(num_experts: int, top_k: int) -> list[str]:
    why = []
    if top_k > 64:
        why.append(f"top_k {top_k} > 64 (the rounds are unrolled)")
    if num_experts > 4096:
        why.append(f"{num_experts} experts exceed one program's row (4096)")
    return why
