"""The batch-invariant GEMM: C[b] = A[b] @ B[b] with one tile configuration for every M, no split-K.

Why this is invariant: output element (i, j) is computed by the program owning its tile, as a
K-loop over fixed BLOCK_K slices in order, each slice an MMA chain whose shape is fixed by the
constexprs. Nothing about that sequence depends on M (the grid grows, the tile does not), so row i's
bits do not depend on how many rows came with it. cuBLAS, in contrast, picks kernels (and split-K)
from the shape. M is not specialised (`do_not_specialize`): Triton would otherwise compile a separate
kernel for M == 1.

Tiles may depend on (N, K) and the dtypes, which are fixed per weight: `tile_for` gives a smaller
BLOCK_N to narrow weights so that decode (M small, memory-bound) still launches enough programs.
fp32 accumulation always; fp32 operands are multiplied exactly ("ieee", not TF32). Mixed dtypes (a
bf16 activation times the fp32 router gate) upcast both to fp32 in the kernel, as the reference's
x.float() @ W.float().T does. Under the interpreter (`mma`'s INTERP) the products run in fp64: its
bf16 tl.dot is broken (shared NOTES.md) and its fp32 one rounds by the row's place in the tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.errors import BackendError


def interpreting() -> bool:
    return envs.TRITON_INTERPRET.get() == "1"


@dataclass(frozen=True)
class Tile:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


BLOCK_M = 64  # rows per program on the GPU, for every M (wgmma needs 64-row warpgroup tiles)
INTERP_BLOCK_M = 16  # the interpreter's tile (tests cross it with M = 17, 33 ...)


def tile_for(n: int, k: int, dtype: torch.dtype) -> Tile:
    """The one tile for a weight of N columns and K depth: a function of the weight alone, never of M."""
    if interpreting():
        return Tile(INTERP_BLOCK_M, 16, 16, 4, 1)
    if dtype == torch.float32:  # fp32 FMA path (router gate): small tiles, registers are the limit
        return Tile(BLOCK_M, 32, 32, 4, 2)
    # enough programs at M <= 64 for the memory-bound decode GEMMs: >= ~128 column blocks where N allows
    block_n = 128 if n >= 128 * 128 else 64
    return Tile(BLOCK_M, block_n, 64, 4, 4)


@triton.jit
def mma(a, b, acc, INTERP: tl.constexpr, PREC: tl.constexpr):
    """acc + a @ b with fp32 accumulation. On the GPU one MMA chain (tensor cores; fp32 operands exact).

    INTERP (the Triton interpreter): numpy runs tl.dot through BLAS, whose micro-kernels round a tile's
    edge rows differently from its inner rows, so a row's bits would depend on its place in the tile:
    a property of the CPU, not of the GPU's MMA. There the product runs in fp64 (exact products, a
    rounding to fp32 that hides the order of the fp64 sum), then adds into acc.
    """
    if INTERP:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64)).to(tl.float32)
    return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, M, N, K,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    F32: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # consecutive programs share a weight tile (L2 reuse at large M)
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + batch * stride_ab + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kmask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = mma(a, b, acc, INTERP, PREC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    c_ptrs = c_ptr + batch * stride_cb + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N] (any strides: pass W.t() views, no copies).

    The output dtype is a's unless given. When a and b differ in dtype, both are upcast to fp32.
    """
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise BackendError(f"invariant bmm: shapes {tuple(a.shape)} @ {tuple(b.shape)} do not chain")
    bt, m, k = a.shape
    n = b.shape[2]
    if out is None:
        out = torch.empty((bt, m, n), dtype=out_dtype or a.dtype, device=a.device)
    elif tuple(out.shape) != (bt, m, n):
        raise BackendError(f"invariant bmm: out has shape {tuple(out.shape)}, expected {(bt, m, n)}")
    if m == 0 or n == 0 or bt == 0:
        return out
    f32 = a.dtype != b.dtype or a.dtype == torch.float32
    exact = a.dtype == torch.float32 or b.dtype == torch.float32
    t = tile_for(n, k, torch.float32 if exact else a.dtype)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), bt)
    _gemm_kernel[grid](
        a, b, out, m, n, k, a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        F32=f32, PREC="ieee" if f32 else None, INTERP=interpreting(),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, num_warps=t.num_warps, num_stages=t.num_stages,
    )
    return out


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N] (b may be a transposed view, e.g. W.t() of a [N, K] weight)."""
    if a.dim() != 2 or b.dim() != 2:
        raise BackendError(f"invariant mm expects 2-D operands, got {tuple(a.shape)} @ {tuple(b.shape)}")
    return bmm(a.unsqueeze(0), b.unsqueeze(0), out_dtype=out_dtype)[0]


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]^T -> [..., N]."""
    shape = x.shape
    y = mm(x.reshape(-1, shape[-1]), weight.t(), out_dtype=out_dtype)
    return y.view(*shape[:-1], weight.shape[0])
