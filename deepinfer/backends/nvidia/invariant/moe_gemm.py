"""The invariant MoE's grouped GEMM: expert-aligned tiles of BLOCK_M pairs, one tile config for every batch.

The layout is moe_align's (pairs sorted by expert, each expert's run padded to BLOCK_M). A pair's row
is one fixed-order K loop (gemm.mma) whatever its place in the tile or its tile-mates, so its bits do
not depend on the batch. The epilogues round as the native op does (and as fused_moe_gemm does):
DUAL (gate_up): silu(gate) * up with gate, up and silu(gate) rounded to the activation dtype;
MUL_WEIGHT (down): the result rounded to the activation dtype, then times the routing weight in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.nvidia.invariant.gemm import interpreting, mma


@triton.jit
def _aligned_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, npad_ptr,
    N, K, num_pairs, u_off, stride_am, stride_be, stride_bn, stride_cm,
    A_DIV: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(npad_ptr):
        return
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    pmask = pairs < num_pairs
    rows = (pairs // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn + offs_k[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc_g = mma(a, b, acc_g, INTERP, PREC)
        if DUAL:
            u = tl.load(b_ptrs + u_off, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_u = mma(a, u, acc_u, INTERP, PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    act_ty = a_ptr.dtype.element_ty
    if DUAL:
        gate = acc_g.to(act_ty).to(tl.float32)
        up = acc_u.to(act_ty).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(act_ty).to(tl.float32) * up
    elif MUL_WEIGHT:
        wv = tl.load(w_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)
        out = acc_g.to(act_ty).to(tl.float32) * wv[:, None]
    else:
        out = acc_g
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


def tile(dual: bool) -> dict:
    """The one tile (as the default op's tuned BLOCK_M = 64 tile; DUAL reads two slices, so half BLOCK_N)."""
    if interpreting():
        return {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_N": 64 if dual else 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def aligned_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor,
                 expert_ids: torch.Tensor, num_padded: torch.Tensor, num_pairs: int, a_div: int, block_m: int,
                 topk_weights: torch.Tensor | None = None, dual: bool = False) -> None:
    """out[p] = a[p // a_div] @ w[expert(p)]^T (* topk_weights[p]); dual: silu(gate) * up, out [pairs, N/2]."""
    E, N, K = w.shape
    n_out = N // 2 if dual else N
    cfg = tile(dual)
    grid = (expert_ids.shape[0], triton.cdiv(n_out, cfg["BLOCK_N"]))
    _aligned_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else a, sorted_ids, expert_ids, num_padded,
        n_out, K, num_pairs, n_out * w.stride(1), a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None, INTERP=interpreting(),
        PREC="ieee" if a.dtype == torch.float32 else None, BLOCK_M=block_m,
        **cfg,
    )
