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
    if dtype == torch.float32:  # fp32 FMA path (fp32 operands): small tiles, registers are the limit
        return Tile(BLOCK_M, 32, 32, 4, 2)
    # From the H200 sweep (benchmarks/invariant_gemm_sweep.py, 2026-12-01, device time at M = 1, 64, 256;
    # docs/determinism.md): the LM head and the wide dense gate_up want 128-column tiles with 8 warps, weights
    # of 4096+ columns (and the K = 128 absorb) 64 x 64, the narrower ones 32 columns with 128-deep K steps
    # (more programs at small M). Measured end to end against 64 x 64 everywhere, the same day: better at
    # batch 1 (162.7 vs 153.0 tok/s), 64 (4669 vs 4543), 256 (13895 vs 13870) and prefill (37.1k vs 35.6k).
    if n >= 128 * 128:
        return Tile(BLOCK_M, 128, 64, 8, 4)
    if n >= 4096 or k <= 128:
        return Tile(BLOCK_M, 64, 64, 4, 4)
    return Tile(BLOCK_M, 32, 128, 4, 4)


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
        out_dtype: torch.dtype | None = None, tile: Tile | None = None) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N] (any strides: pass W.t() views, no copies).

    The output dtype is a's unless given. When a and b differ in dtype, both are upcast to fp32.
    `tile` overrides tile_for (benchmarks/invariant_gemm_sweep.py; a fixed tile per weight keeps the
    invariance, whichever tile it is).
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
    t = tile or tile_for(n, k, torch.float32 if exact else a.dtype)
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


def split_gate(gate: torch.Tensor) -> torch.Tensor:
    """An fp32 weight [N, K] -> bf16 [3N, K]: hi, mid and lo parts with hi + mid + lo == gate exactly.

    bf16 keeps fp32's exponent and 8 of its 24 mantissa bits; each part takes the next 8 bits of what the
    previous parts left (a residual of an fp32 minus its bf16 rounding is exact in fp32), so three parts hold
    every bit (fp32 subnormals aside, which bf16 also has)."""
    hi = gate.to(torch.bfloat16)
    r1 = gate - hi.float()
    mid = r1.to(torch.bfloat16)
    lo = (r1 - mid.float()).to(torch.bfloat16)
    return torch.cat([hi, mid, lo], 0).contiguous()


def router_linear(x: torch.Tensor, gate_split: torch.Tensor) -> torch.Tensor:
    """bf16 x [T, K] times the fp32 gate that `split_gate` split -> fp32 logits [T, N], on the tensor cores.

    A bf16 x bf16 product is exact in fp32, so x @ (hi + mid + lo) is the exact-product fp32 dot done as one
    bf16 GEMM of 3N columns (fp32 accumulation) and two fixed-order adds: the same tile for every M, so as
    invariant as the other GEMMs, and about 15x faster on the H200 than the fp32 FMA path at the V2-Lite
    router's shape (benchmarks/invariant_gemm_sweep.py), whose 64 columns give that path two programs."""
    if x.dtype != torch.bfloat16 or gate_split.dtype != torch.bfloat16 or gate_split.shape[0] % 3:
        raise BackendError(f"router_linear: bf16 x and a split bf16 gate [3N, K], got {x.dtype} / "
                           f"{gate_split.dtype} {tuple(gate_split.shape)}")
    n = gate_split.shape[0] // 3
    parts = linear(x, gate_split, out_dtype=torch.float32)
    return (parts[..., :n] + parts[..., n: 2 * n]) + parts[..., 2 * n:]
