"""fp8 block-scaled W8A8 GEMM for Hopper: y[M, N] = (A_q * A_s) @ (B_q * B_s)^T, fp32 accumulation.

A_q e4m3 [M, K] with fp32 A_s [M, ceil(K/128)] (per token per 128 channels, fp8_act_quant.py);
B_q e4m3 [N, K] with fp32 B_s [ceil(N/128), ceil(K/128)] (the checkpoint's 128x128 weight_scale_inv).
BLOCK_K is 128, so each K step is one scale block: the fp8 tensor-core product of the step
(tl.dot on float8e4nv operands, fp32 out) is multiplied by A_s[:, kb] (a column) and B_s[nb, kb]
(per output column: BLOCK_N <= 128 divides 128, so a column's scale row is offs_n // 128) and
added to the fp32 accumulator. Partial edge tiles (M, N, K not multiples of the blocks) are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K, stride_am, stride_bn, stride_cm,
                     stride_as, stride_bs, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M row tiles share each weight tile while it is in L2
    width = GROUP_M * num_n
    group = pid // width
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_n[None, :] * stride_bn + offs_k[:, None]  # [BLOCK_K, BLOCK_N] view of B^T
    as_ptrs = as_ptr + offs_m * stride_as
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        kmask = offs_k < K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mmask, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def _tiles(m: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small tiles under the interpreter; on the GPU a narrow M tile
    for decode-sized M (the weight stream is the cost) and 128x128 for prefill."""
    if not on_gpu:
        return 16, 32, 4, 1
    if m <= 16:
        return 16, 64, 4, 5
    if m <= 64:
        return 64, 128, 4, 4
    return 128, 128, 8, 3


def fp8_block_gemm(a_q: torch.Tensor, a_s: torch.Tensor, b_q: torch.Tensor, b_s: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K]^T with both scales applied per 128-wide K block; returns [M, N] in out_dtype."""
    m, k = a_q.shape
    n = b_q.shape[0]
    c = torch.empty((m, n), dtype=out_dtype, device=a_q.device)
    if m == 0:
        return c
    bm, bn, warps, stages = _tiles(m, a_q.device.type == "cuda")
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _fp8_gemm_kernel[grid](a_q, a_s, b_q, b_s, c, bias if bias is not None else c, m, n, k,
                           a_q.stride(0), b_q.stride(0), c.stride(0), a_s.stride(0), b_s.stride(0),
                           HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8,
                           num_warps=warps, num_stages=stages)
    return c
