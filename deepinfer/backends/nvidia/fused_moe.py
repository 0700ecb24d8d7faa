"""Fused MoE grouped GEMM in Triton over expert-sorted (token, slot) pairs.

Each program takes BLOCK_M pairs routed to one expert (moe_align's layout)
and a BLOCK_N slice of that expert's output features, so every expert weight
tile is read once per block of its tokens. The down projection multiplies by
the routing weight in the epilogue; the k slots of a token are summed after.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from deepinfer.backends.nvidia.activation import silu_and_mul
from deepinfer.backends.nvidia.moe_routing import moe_align


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, npad_ptr,
    N, K, num_pairs, stride_am, stride_be, stride_bn, stride_cm,
    A_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
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
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:  # round to the activation dtype first, then weight in fp32 (as the native op)
        w = tl.load(w_ptr + pairs, mask=pmask, other=0.0)
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * w[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


def _pick_block_m(num_pairs: int, num_experts: int, interpret: bool) -> int:
    if interpret:
        return 16
    per_expert = num_pairs / max(1, num_experts)
    return 16 if per_expert <= 16 else (32 if per_expert <= 64 else 64)


def gemm_config(block_m: int, interpret: bool) -> dict:
    """Tile shape per BLOCK_M; DEEPINFER_MOE_TILE="BN,BK,warps,stages" overrides it (for tuning runs)."""
    if interpret:
        return {"block_n": 32, "block_k": 16, "num_warps": 4, "num_stages": 1}
    env = os.environ.get("DEEPINFER_MOE_TILE")
    if env:
        bn, bk, warps, stages = (int(v) for v in env.split(","))
        return {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}
    if block_m <= 32:  # decode: H200 sweep (docs/performance.md): all tiles within ~10%, this one best at 1 token
        return {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}
    return {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_padded: torch.Tensor, num_pairs: int, a_div: int, block_m: int, topk_weights: torch.Tensor | None,
) -> None:
    """out[p] = a[p // a_div] @ w[expert(p)]^T (* topk_weights[p]) for every routed pair p."""
    E, N, K = w.shape
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    cfg = gemm_config(block_m, interpret)
    block_n, block_k = cfg["block_n"], cfg["block_k"]
    grid = (expert_ids.shape[0], triton.cdiv(N, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else a, sorted_ids, expert_ids, num_padded,
        N, K, num_pairs, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_DIV=a_div, MUL_WEIGHT=topk_weights is not None, UPCAST=interpret and a.dtype == torch.bfloat16,
        PREC="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def fused_moe(
    x: torch.Tensor,  # [T, D]
    w13: torch.Tensor,  # [E, 2I, D]
    w2: torch.Tensor,  # [E, D, I]
    topk_weights: torch.Tensor,  # [T, k] fp32
    topk_ids: torch.Tensor,  # [T, k] int64
    align=moe_align,
) -> torch.Tensor:  # [T, D]
    T, D = x.shape
    E, two_i, _ = w13.shape
    k = topk_ids.shape[1]
    n = T * k
    if T == 0:
        return torch.zeros_like(x)
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    block_m = _pick_block_m(n, E, interpret)
    sorted_ids, expert_ids, num_padded = align(topk_ids, E, block_m)
    x = x.contiguous()
    h13 = torch.empty((n, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, h13, sorted_ids, expert_ids, num_padded, n, k, block_m, None)
    h = silu_and_mul(h13)
    y = torch.empty((n, D), dtype=torch.float32, device=x.device)  # weighted slots, summed in fp32
    grouped_gemm(h, w2, y, sorted_ids, expert_ids, num_padded, n, 1, block_m,
                 topk_weights.reshape(-1).float().contiguous())
    return y.view(T, k, D).sum(dim=1).to(x.dtype)
