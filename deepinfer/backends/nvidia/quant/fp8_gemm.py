"""fp8 block-scaled W8A8 GEMM for Hopper: y[M, N] = (A_q * A_s) @ (B_q * B_s)^T, fp32 accumulation.

B_q e4m3 [N, K] with fp32 B_s [ceil(N/128), ceil(K/128)] (the checkpoint's 128x128 weight_scale_inv). The A
side comes in one of two forms (A_MODE):
- 1: A_q e4m3 [M, K] with fp32 A_s [M, ceil(K/128)], from fp8_act_quant.py (prefill-sized M: A is quantized
  once, not once per N tile);
- 2: A in the compute dtype, quantized per row per 128 channels as the tile is loaded (quant/tiles.py
  fp8_quant_rows, the same values and scales as the separate kernel): decode-sized M, where the separate
  launch costs more than re-quantizing a few rows in each of the N tiles.
BLOCK_K is 128, so each K step is one scale block: the fp8 tensor-core product of the step (tl.dot on
float8e4nv operands, fp32 out; QGMMA on Hopper when BLOCK_M >= 64) is multiplied by A_s[:, kb] and
B_s[nb, kb] (per output column: a column's scale row is offs_n // 128) and added to the fp32 accumulator,
DeepGEMM's promotion of every 128-K partial sum to fp32. Partial edge tiles are masked.

Tiles (`tiles`): at decode sizes the weight stream is the cost, so the M tile is the narrowest the MMA takes
(16) and N tiles narrow to 32 where 64-wide ones would leave SMs idle; at prefill sizes 128x128 tiles with 8
warps (two warpgroups, four pipeline stages: 32 KB of A and B per stage). The same shapes as vLLM's tuned
block-fp8 Triton configs on H100 / H200; `tile=` overrides them for benchmarks/quant_gemm.py's sweep.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.quant import split_k
from deepinfer.backends.nvidia.quant.tiles import fp8_quant_rows

BLOCK_K = 128
SM_COUNT = 132  # H200 / H100 SXM; only steers the narrow-tile choice


@triton.jit
def _fp8_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, bias_ptr, M, N, K, KB_PER, stride_am, stride_bn,
                     stride_cm, stride_as, stride_bs, HAS_BIAS: tl.constexpr, A_MODE: tl.constexpr,
                     ROUND_FIRST: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """Program (tile, s): K blocks [s * KB_PER, (s + 1) * KB_PER) of one output tile; with one split (grid dim 1 of
    size 1, KB_PER all of K) c is the output, else c is split s's fp32 partial [M, N] in split_k's workspace."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    kb_lo = pid_k * KB_PER
    kb_hi = tl.minimum(kb_lo + KB_PER, tl.cdiv(K, BLOCK_K))
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
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + (kb_lo * BLOCK_K + offs_k)[None, :]
    # [BLOCK_K, BLOCK_N] view of B^T
    b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_bn + (kb_lo * BLOCK_K + offs_k)[:, None]
    as_ptrs = as_ptr + offs_m * stride_as
    bs_ptrs = bs_ptr + (offs_n // 128) * stride_bs
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(kb_lo, kb_hi):
        kmask = offs_k < K - kb * BLOCK_K
        if A_MODE == 1:
            a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
            a_s = tl.load(as_ptrs + kb, mask=mmask, other=0.0)
        else:
            x = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            a, a_s = fp8_quant_rows(x, ROUND_FIRST)
        b = tl.load(b_ptrs, mask=nmask[None, :] & kmask[:, None], other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + pid_k.to(tl.int64) * M * N + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def tiles(m: int, n: int, on_gpu: bool) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for an [m, K] x [n, K]^T product."""
    if not on_gpu:
        return 16, 32, 4, 1
    if m <= 16:
        return 16, 64 if triton.cdiv(n, 64) >= SM_COUNT else 32, 4, 5
    if m <= 32:
        return 32, 64 if triton.cdiv(n, 64) >= SM_COUNT else 32, 4, 4
    if m <= 64:
        return 64, 64 if triton.cdiv(n, 128) < SM_COUNT else 128, 4, 4
    if m <= 256:
        return 64, 128, 4, 4
    return 128, 128, 8, 4


def fused_act_quant(m: int) -> bool:
    """Whether an M-row product quantizes A as it loads it (DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M)."""
    return m <= envs.FP8_FUSED_ACT_QUANT_MAX_M.get()


def fp8_block_gemm(a: torch.Tensor, a_s: torch.Tensor | None, b_q: torch.Tensor, b_s: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   tile: tuple[int, int, int, int] | None = None, split: int | None = None) -> torch.Tensor:
    """[M, K] x [N, K]^T with both scales applied per 128-wide K block; returns [M, N] in out_dtype.

    a_s given: `a` is e4m3 with those scales (fp8_act_quant.py); a_s None: `a` is in the compute dtype and is
    quantized inside the GEMM (the same values: each split quantizes its own 128-channel groups). tile: (BLOCK_M,
    BLOCK_N, warps, stages), for sweeps; split: K splits (quant/split_k.py; None: its choice)."""
    m, k = a.shape
    n = b_q.shape[0]
    if a.stride(1) != 1:
        a = a.contiguous()
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0:
        return c
    on_gpu = a.device.type == "cuda"
    bm, bn, warps, stages = tile or tiles(m, n, on_gpu)
    programs = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # K splits up to 16 rows, and up to FP8_MAX_M with x quantized apart (from 65 rows: the shapes cuBLAS cannot take)
    max_m = split_k.FP8_MAX_M if a_s is not None else split_k.MAX_M
    splits, per, ws = split_k.plan(m, n, programs, triton.cdiv(k, BLOCK_K), a.device, split, max_m)
    out = c if ws is None else ws
    _fp8_gemm_kernel[(programs, splits)](
        a, a_s if a_s is not None else a, b_q, b_s, out, bias if bias is not None and splits == 1 else out, m, n, k,
        per, a.stride(0), b_q.stride(0), n if splits > 1 else c.stride(0), a_s.stride(0) if a_s is not None else 0,
        b_s.stride(0), HAS_BIAS=bias is not None and splits == 1, A_MODE=1 if a_s is not None else 2,
        ROUND_FIRST=not on_gpu, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK_K, GROUP_M=8, num_warps=warps,
        num_stages=stages)
    return c if splits == 1 else split_k.reduce_partials(out, c, bias)
