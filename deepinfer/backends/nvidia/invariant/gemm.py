"""The batch-invariant GEMM: C[b] = A[b] @ B[b] with one tile and one K split for every M.

Why this is invariant: output element (i, j) is one fixed sum. K is cut into the weight's S fixed slices
(slice s covers [s * slice_k, (s + 1) * slice_k), the last one shorter), each slice is a K-loop over fixed
BLOCK_K steps in order, each step an MMA chain whose shape is fixed by the constexprs, and the slices'
fp32 partials are added left to right from zero: r = ((0 + p_0) + p_1) + ... Nothing about that sequence
depends on M (the grid grows, the tile does not), so row i's bits do not depend on how many rows came
with it. cuBLAS, in contrast, picks kernels (and split-K) from the shape. M is not specialised
(`do_not_specialize`): Triton would otherwise compile a separate kernel for M == 1.

The split is a property of the weight (`plan_for`: N, K, the batch of weights, the dtype), like the tile:
it exists so that small M still launches enough programs (a weight of 2048 columns in 128-column tiles is
16 programs; its 8 slices make 128). Two schedules compute the SAME sum, and the caller picks one from M:
- serial: one program per output tile runs its slices one after another, adding each into r;
- parallel (small M): one program per (tile, slice) writes its fp32 partial, and the last of a tile's
  programs to arrive (an arrival counter, counters.py) loads the S partials and adds them in slice order.
Both add the same fp32 values in the same order (fp32 partials are stored exactly), so the choice changes
the speed, not the bits; the tests check that bitwise. This is the "fixed split of a reduction" of
docs/determinism.md, not cuBLAS's split-K: the split never depends on M.

Tiles and splits may depend on (N, K) and the dtypes, which are fixed per weight. fp32 accumulation
always; fp32 operands are multiplied exactly ("ieee", not TF32). Mixed dtypes (a bf16 activation times the
fp32 router gate) upcast both to fp32 in the kernel, as the reference's x.float() @ W.float().T does. Under
the interpreter (`mma`'s INTERP) the products run in fp64: its bf16 tl.dot is broken (shared NOTES.md) and
its fp32 one rounds by the row's place in the tile.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.invariant.counters import COUNTERS, tile_counters
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


@dataclass(frozen=True)
class Plan:
    """A weight's tile and K split: slices of slice_k elements (a multiple of block_k; the last one shorter)."""

    tile: Tile
    slice_k: int

    def slices(self, k: int) -> int:
        return max(1, triton.cdiv(k, self.slice_k))


BLOCK_M = 64  # rows per program on the GPU, for every M (wgmma needs 64-row warpgroup tiles)
INTERP_BLOCK_M = 16  # the interpreter's tile (tests cross it with M = 17, 33 ...)
INTERP_SLICE_K = 32  # the interpreter's slice: K = 40 in the tests gives two slices, the last one ragged
TARGET_PROGRAMS = 192  # at M <= BLOCK_M a weight's tiles x slices reach about this (132 SMs on the H200)
MIN_SLICE_K = 256  # a slice stays >= 4 BLOCK_K steps: each slice restarts the serial schedule's pipeline
MAX_SLICES = 8
NUM_SMS = 132  # the parallel schedule pays below one program per SM (H200; a speed choice, not a bit one)
LARGE_M = 1024  # rows from which a weight takes its large tile, once tile_choice.py checked it on this device
# (batch, N, K) of bf16 weights -> the large tile that gave the plan's bits on this device (tile_choice.check_gemm
# fills it at load; empty: every M takes the plan's tile)
CHECKED_LARGE_TILES: dict[tuple[int, int, int], Tile] = {}


def tile_for(n: int, k: int, dtype: torch.dtype) -> Tile:
    """The one tile for a weight of N columns and K depth: a function of the weight alone, never of M."""
    if interpreting():
        return Tile(INTERP_BLOCK_M, 16, 16, 4, 1)
    if dtype == torch.float32:  # fp32 FMA path (fp32 operands): small tiles, registers are the limit
        return Tile(BLOCK_M, 32, 32, 4, 2)
    # The LM head and the wide dense gate_up: 128-column tiles with 8 warps (H200 sweep, 2026-12-01). Weights of
    # 1024+ columns: 64 x 128 with one warpgroup, for prefill's large M (a 64 x 128 x 64 step does 43 flops per
    # byte it loads; the 32-column tiles the decode-only sweep picked did 21 and re-read the activations 64 times
    # per 2048 columns); the narrow ones 64 x 64. The K slices (plan_for) give small M its programs instead.
    # Not yet swept at prefill sizes: benchmarks/invariant_gemm_sweep.py times M = 1, 64, 256 and 8192.
    if n >= 128 * 128:
        return Tile(BLOCK_M, 128, 64, 8, 4)
    if n >= 1024:
        return Tile(BLOCK_M, 128, 64, 4, 3)
    return Tile(BLOCK_M, 64, 64, 4, 4)


# Plans swept on the H200 (benchmarks/invariant_gemm_sweep.py --shapes hot, 2026-12-03, commit 318216d): per bf16
# weight [batch, N, K] of V2-Lite's decode step, the plan with the least sum over M = 1, 64, 256, 8192 of time /
# cuBLAS time (every candidate checked invariant on the GPU). Device µs at M = 1 / 64 / 256 / 8192 against the
# formula's plan: the merged q + kv_a 9.0 / 9.8 / 14.7 / 365 (was 11.0 / 18.1 / 23.7 / 375), o_proj 8.4 / 9.2 /
# 11.1 / 191 (9.1 / 14.0 / 28.8 / 209), W_UK 2.8 / 3.2 / 4.5 / 85 (2.4 / 2.6 / 6.0 / 111), W_UV 3.4 / 3.5 / 4.0 / 62
# (4.5 / 5.2 / 5.0 / 74), the router's split gate 6.4 / 6.9 / 7.2 / 20.5 (6.1 / 7.4 / 7.7 / 26.1). The LM head
# kept its plan. Other shapes (V3's widths) take the formula below. A plan is a property of the weight, so
# whichever plan a weight gets, its rows stay invariant.
SWEPT_BF16: dict[tuple[int, int, int], Plan] = {
    (1, 3648, 2048): Plan(Tile(BLOCK_M, 64, 128, 4, 3), 1024),  # q_proj + kv_a_proj_with_mqa (merged)
    (1, 2048, 2048): Plan(Tile(BLOCK_M, 64, 64, 4, 4), 1024),  # o_proj
    (16, 512, 128): Plan(Tile(BLOCK_M, 128, 64, 4, 3), 128),  # W_UK absorb (16 heads)
    (16, 128, 512): Plan(Tile(BLOCK_M, 64, 64, 4, 4), 512),  # W_UV (16 heads)
    (1, 192, 2048): Plan(Tile(BLOCK_M, 64, 64, 4, 4), 1024),  # the router's fp32 gate as three bf16 parts
}


def plan_for(batch: int, n: int, k: int, dtype: torch.dtype) -> Plan:
    """The tile and the K split of a weight [batch, K, N]: functions of the weight alone, never of M.

    A swept plan (SWEPT_BF16) where there is one; otherwise the formula:

    the fewest power-of-two slices (<= MAX_SLICES, each >= MIN_SLICE_K deep) that give
    batch x column tiles x slices >= TARGET_PROGRAMS, so a decode GEMM at M <= 64 fills the GPU; none for a
    weight whose column tiles alone fill the SMs (the split would only cost prefill its pipeline restarts)."""
    tile = tile_for(n, k, dtype)
    if interpreting():
        return Plan(tile, INTERP_SLICE_K)
    if dtype == torch.bfloat16 and (batch, n, k) in SWEPT_BF16:
        return SWEPT_BF16[(batch, n, k)]
    if dtype == torch.float32:
        return Plan(tile, triton.cdiv(k, tile.block_k) * tile.block_k)
    tiles = batch * triton.cdiv(n, tile.block_n)
    slices = 1
    while (slices < MAX_SLICES and tiles < NUM_SMS and tiles * slices < TARGET_PROGRAMS
           and k >= 2 * slices * MIN_SLICE_K):
        slices *= 2
    slice_k = triton.cdiv(triton.cdiv(k, slices), tile.block_k) * tile.block_k
    return Plan(tile, slice_k)


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


@triton.jit
def _slice(a_ptrs, b_ptrs, k_lo, k_hi, mmask, nmask, stride_ak, stride_bk,
           F32: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The fp32 partial of K range [k_lo, k_hi): BLOCK_K steps in order from a zero accumulator."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs += k_lo * stride_ak
    b_ptrs += k_lo * stride_bk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = offs_k + k0 < k_hi
        a = tl.load(a_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if F32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = mma(a, b, acc, INTERP, PREC)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(
    a_ptr, b_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K, slice_k,
    stride_ab, stride_am, stride_ak, stride_bb, stride_bk, stride_bn, stride_cb, stride_cm, stride_cn,
    SLICES: tl.constexpr, PARALLEL: tl.constexpr, F32: tl.constexpr, PREC: tl.constexpr, INTERP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    tiles = num_m * tl.cdiv(N, BLOCK_N)
    tile = pid % tiles
    pid_m = tile % num_m  # consecutive programs share a weight tile (L2 reuse at large M)
    pid_n = tile // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    nmask = offs_n < N
    a_ptrs = a_ptr + batch * stride_ab + offs_m.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + batch * stride_bb + offs_k[:, None] * stride_bk + offs_n.to(tl.int64)[None, :] * stride_bn
    c_ptrs = c_ptr + batch * stride_cb + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    cmask = mmask[:, None] & nmask[None, :]
    if SLICES == 1:
        r = _slice(a_ptrs, b_ptrs, 0, K, mmask, nmask, stride_ak, stride_bk, F32, PREC, INTERP,
                   BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(c_ptrs, r.to(c_ptr.dtype.element_ty), mask=cmask)
    elif PARALLEL:  # program (tile, s): slice s's partial; the tile's last arrival folds all S in order
        s = pid // tiles
        p = _slice(a_ptrs, b_ptrs, s * slice_k, tl.minimum(s * slice_k + slice_k, K), mmask, nmask,
                   stride_ak, stride_bk, F32, PREC, INTERP, BLOCK_M, BLOCK_N, BLOCK_K)
        ws = ws_ptr + (batch * SLICES * M + offs_m.to(tl.int64))[:, None] * N + offs_n[None, :]
        tl.store(ws + s * M * N, p, mask=cmask)
        tl.debug_barrier()  # every thread's partial stores happen before the (acq_rel, gpu-scope) increment
        cnt = cnt_ptr + batch * tiles + tile
        if tl.atomic_add(cnt, 1) == SLICES - 1:
            r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(SLICES):  # slice order, as the serial schedule; read through L2 (.cg)
                r = r + tl.load(ws + j * M * N, mask=cmask, other=0.0, cache_modifier=".cg")
            tl.store(c_ptrs, r.to(c_ptr.dtype.element_ty), mask=cmask)
            tl.atomic_xchg(cnt, 0)
    else:  # serial: this program's slices one after another, the same fold
        r = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SLICES):
            r = r + _slice(a_ptrs, b_ptrs, s * slice_k, tl.minimum(s * slice_k + slice_k, K), mmask, nmask,
                           stride_ak, stride_bk, F32, PREC, INTERP, BLOCK_M, BLOCK_N, BLOCK_K)
        tl.store(c_ptrs, r.to(c_ptr.dtype.element_ty), mask=cmask)


def parallel_pays(tiles: int, slices: int, m: int, k: int) -> bool:
    """The parallel schedule when the serial grid fills at most half the SMs, or leaves some idle while the fp32
    partials (written and read: 8 * S * M * N bytes) stay within the weight's own bytes (2 * N * K). Speed
    only: both give the same bits."""
    if slices == 1 or tiles * slices > COUNTERS:
        return False
    return tiles <= NUM_SMS // 2 or (tiles < NUM_SMS and 4 * slices * m <= k)


def bmm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None,
        out_dtype: torch.dtype | None = None, plan: Plan | None = None,
        parallel: bool | None = None, tile: Tile | None = None) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N] (any strides: pass W.t() views, no copies).

    The output dtype is a's unless given. When a and b differ in dtype, both are upcast to fp32.
    `plan` overrides plan_for (benchmarks/invariant_gemm_sweep.py; a fixed plan per weight keeps the
    invariance, whichever plan it is). `parallel` forces a schedule (None: the faster one; the same bits).
    `tile` overrides the plan's tile, keeping its K split (tile_choice.py checks that it keeps the bits); without
    plan and tile, M >= LARGE_M takes the weight's checked large tile where it has one.
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
    p = plan or plan_for(bt, n, k, torch.float32 if exact else a.dtype)
    if tile is None and plan is None and m >= LARGE_M and not exact and a.dtype == torch.bfloat16:
        tile = CHECKED_LARGE_TILES.get((bt, n, k))
    t = tile or p.tile
    slices = p.slices(k)
    tiles = triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n)
    if parallel is None:
        parallel = parallel_pays(tiles * bt, slices, m, k)
    parallel = parallel and slices > 1
    if parallel:
        ws = torch.empty((bt, slices, m, n), dtype=torch.float32, device=a.device)
        cnt = tile_counters(a.device, bt * tiles)
    else:
        ws = cnt = out
    grid = (tiles * (slices if parallel else 1), bt)
    _gemm_kernel[grid](
        a, b, out, ws, cnt, m, n, k, p.slice_k, a.stride(0), a.stride(1), a.stride(2),
        b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1), out.stride(2),
        SLICES=slices, PARALLEL=parallel, F32=f32, PREC="ieee" if f32 else None, INTERP=interpreting(),
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
