"""int4 weight-only GEMM: y[M, N] = x[M, K] @ W^T with W dequantized in the inner loop, never in memory.

The weight is held in one layout for AWQ and GPTQ alike (repacked at load, still 4 bits a value):
qweight int32 [K/8, N] with input row 8i + j in nibble j of word i, zeros and scales fp16 [G, N]
(the zero offset of GPTQ v1 already added), and g_idx int32 [K], the group of each input row
(k // 128 for AWQ; the checkpoint's own for GPTQ, so act-order works unchanged). Each program
loads a [BLOCK_K, BLOCK_N] tile of words (each word serves 8 rows: the repeats hit L1), shifts
out the nibbles, applies (q - z) * s in fp32, rounds to the activation dtype and feeds tl.dot;
the DRAM traffic is the 4-bit stream, which is what decode at small M waits on.

UPCAST (the interpreter: bf16 tl.dot is wrong there, NOTES.md): both operands go to fp32 instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.errors import BackendError


@triton.jit
def _int4_gemm_kernel(x_ptr, qw_ptr, z_ptr, s_ptr, g_ptr, c_ptr, bias_ptr, M, N, K, stride_xm, stride_cm,
                      HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    shifts = ((offs_k % 8) * 4)[:, None]
    for k0 in range(0, K, BLOCK_K):
        rows = k0 + offs_k
        words = tl.load(qw_ptr + (rows // 8)[:, None] * N + offs_n[None, :], mask=nmask[None, :], other=0)
        q = (words >> shifts) & 0xF
        grp = tl.load(g_ptr + rows)
        z = tl.load(z_ptr + grp[:, None] * N + offs_n[None, :], mask=nmask[None, :], other=0.0).to(tl.float32)
        s = tl.load(s_ptr + grp[:, None] * N + offs_n[None, :], mask=nmask[None, :], other=0.0).to(tl.float32)
        w = (q.to(tl.float32) - z) * s
        a = tl.load(x_ptr + offs_m[:, None] * stride_xm + rows[None, :], mask=mmask[:, None], other=0.0)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), w.to(a.dtype).to(tl.float32))
        else:
            acc += tl.dot(a, w.to(a.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def _tiles(m: int, on_gpu: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); int4_gemm halves BLOCK_K until it divides K (the
    loads are not masked along K; K is a multiple of the group size, 32 at least)."""
    if not on_gpu:
        return 16, 32, 32, 4, 1
    if m <= 16:
        return 16, 64, 128, 4, 4
    if m <= 64:
        return 64, 64, 64, 4, 4
    return 128, 128, 64, 8, 3


def int4_gemm(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (compute dtype) -> [M, N] in x's dtype; the weight in this module's layout (see the docstring)."""
    m, k = x.shape
    n = qweight.shape[1]
    if x.stride(1) != 1:
        x = x.contiguous()
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c
    on_gpu = x.device.type == "cuda"
    bm, bn, bk, warps, stages = _tiles(m, on_gpu)
    while k % bk:
        bk //= 2
    if bk < 8:
        raise BackendError(f"int4_gemm: in_features {k} is not a multiple of 8")
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _int4_gemm_kernel[grid](x, qweight, zeros, scales, g_idx, c, bias if bias is not None else c, m, n, k,
                            x.stride(0), c.stride(0), HAS_BIAS=bias is not None, UPCAST=not on_gpu,
                            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return c
