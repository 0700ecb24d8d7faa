"""The invariant MoE's grouped GEMM: expert-aligned blocks of BLOCK_M pairs, one tile and one K split for every T.

The layout is moe_align.py's: block b holds block_rows[b] pairs of expert block_expert[b] (sorted_ids); expert
E + s is shared expert s, whose weights are read in place from the dense shared MLP (gate_up [2*S*I, D] holds
S*I gate rows then S*I up rows; down [D, S*I] holds expert s in columns s*I..). A pair's row is one fixed sum:
K cut into the weight's fixed slices (`plan`), each slice a fixed-order loop of gemm.mma steps, the slices'
fp32 partials added in order from zero, whatever the row's place in its tile or its tile-mates. So its bits do
not depend on the batch. As in gemm.py, the slices run one after another in one program (serial) or one per
program with the last arrival folding them (parallel, small batches): the same additions, the same bits.

The epilogues round as the native op does (and as fused_moe_gemm does):
DUAL (gate_up): silu(gate) * up with gate, up and silu(gate) rounded to the activation dtype;
MUL_WEIGHT (down): the result rounded to the activation dtype, then times the routing weight in fp32 (a shared
expert's weight is 1.0), stored fp32 for the combine.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.nvidia.fused_moe_gemm import shared_layout
from deepinfer.backends.nvidia.invariant.counters import COUNTERS, tile_counters
from deepinfer.backends.nvidia.invariant.gemm import NUM_SMS, interpreting, mma
from deepinfer.backends.nvidia.invariant.moe_align import Alignment

# K per slice on the GPU: 2048 = no split at V2-Lite's K (gate_up 2048, down 1408). The H200 sweep of 2026-12-03
# (benchmarks/invariant_gemm_sweep.py --moe, routed + shared experts of one layer) timed 1024 (two slices) slower
# at every T: 59.7 / 309 / 332 / 3394 µs against 58.3 / 296 / 310 / 3003 at T = 1 / 64 / 256 / 8192.
MOE_SLICE_K = 2048


@triton.jit
def _moe_slice(a_ptr, rows, pmask, stride_am, base, u_off, bstride, offs_n, nmask, k_lo, k_hi,
               DUAL: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """(gate, up) fp32 partials of K range [k_lo, k_hi) from zero accumulators (up only when DUAL)."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + (k_lo + offs_k)[None, :]
    b_ptrs = base + offs_n.to(tl.int64)[None, :] * bstride + (k_lo + offs_k)[:, None]
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kmask = offs_k + k0 < k_hi
        a = tl.load(a_ptrs, mask=pmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc_g = mma(a, b, acc_g, INTERP, PREC)
        if DUAL:
            u = tl.load(b_ptrs + u_off, mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc_u = mma(a, u, acc_u, INTERP, PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _epilogue(acc_g, acc_u, c_ptr, w_ptr, pairs, pmask, offs_n, cmask, stride_cm, act_ty: tl.constexpr,
              TOP_K: tl.constexpr, SLOTS: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    if DUAL:
        gate = acc_g.to(act_ty).to(tl.float32)
        up = acc_u.to(act_ty).to(tl.float32)
        out = (gate / (1.0 + tl.exp(-gate))).to(act_ty).to(tl.float32) * up
    elif MUL_WEIGHT:  # routed slots carry their routing weight, shared experts 1.0
        slot = pairs % SLOTS
        routed = slot < TOP_K
        wv = tl.load(w_ptr + (pairs // SLOTS) * TOP_K + slot, mask=pmask & routed, other=0.0).to(tl.float32)
        out = acc_g.to(act_ty).to(tl.float32) * tl.where(routed, wv, 1.0)[:, None]
    else:
        out = acc_g
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=cmask)


@triton.jit
def _aligned_kernel(
    a_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, sorted_ptr, bexp_ptr, brows_ptr, ws_ptr, cnt_ptr,
    N, K, E, slice_k, ws_rows, u_off, us_off, shared_step, stride_am, stride_be, stride_bn, stride_sn, stride_cm,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, A_DIV: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    SLICES: tl.constexpr, PARALLEL: tl.constexpr, PLANES: tl.constexpr, INTERP: tl.constexpr, PREC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(bexp_ptr + pid_m)
    if expert < 0:  # a block past the used ones: exits at once
        return
    offs_m = tl.arange(0, BLOCK_M)
    pmask = offs_m < tl.load(brows_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m, mask=pmask, other=0)
    rows = (pairs // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    shared = expert >= E
    base = tl.where(shared, bs_ptr + tl.maximum(expert - E, 0).to(tl.int64) * shared_step,
                    b_ptr + tl.minimum(expert, E - 1).to(tl.int64) * stride_be)
    u_shift = tl.where(shared, us_off, u_off)
    bstride = tl.where(shared, stride_sn, stride_bn)
    cmask = pmask[:, None] & nmask[None, :]
    act_ty = a_ptr.dtype.element_ty
    if SLICES == 1:
        acc_g, acc_u = _moe_slice(a_ptr, rows, pmask, stride_am, base, u_shift, bstride, offs_n, nmask, 0, K,
                                  DUAL, INTERP, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        _epilogue(acc_g, acc_u, c_ptr, w_ptr, pairs, pmask, offs_n, cmask, stride_cm, act_ty, TOP_K, SLOTS, DUAL,
                  MUL_WEIGHT)
    elif PARALLEL:  # program (block, column tile, slice s); the tile's last arrival folds the S partials
        s = tl.program_id(2)
        k_lo = s * slice_k
        p_g, p_u = _moe_slice(a_ptr, rows, pmask, stride_am, base, u_shift, bstride, offs_n, nmask, k_lo,
                              tl.minimum(k_lo + slice_k, K), DUAL, INTERP, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
        ws = ws_ptr + (pid_m * BLOCK_M + offs_m).to(tl.int64)[:, None] * N + offs_n[None, :]
        plane = ws_rows * N  # one [rows, N] plane per slice and projection (gate, and up when DUAL)
        tl.store(ws + (PLANES * s) * plane, p_g, mask=cmask)
        if DUAL:
            tl.store(ws + (PLANES * s + 1) * plane, p_u, mask=cmask)
        tl.debug_barrier()  # every thread's partial stores happen before the (acq_rel, gpu-scope) increment
        cnt = cnt_ptr + pid_m * tl.num_programs(1) + pid_n
        if tl.atomic_add(cnt, 1) == SLICES - 1:
            acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for j in range(SLICES):  # slice order, as the serial schedule; read through L2 (.cg)
                acc_g = acc_g + tl.load(ws + (PLANES * j) * plane, mask=cmask, other=0.0, cache_modifier=".cg")
                if DUAL:
                    acc_u = acc_u + tl.load(ws + (PLANES * j + 1) * plane, mask=cmask, other=0.0,
                                            cache_modifier=".cg")
            _epilogue(acc_g, acc_u, c_ptr, w_ptr, pairs, pmask, offs_n, cmask, stride_cm, act_ty, TOP_K, SLOTS,
                      DUAL, MUL_WEIGHT)
            tl.atomic_xchg(cnt, 0)
    else:  # serial: the slices one after another, the same fold
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for s in range(SLICES):
            k_lo = s * slice_k
            p_g, p_u = _moe_slice(a_ptr, rows, pmask, stride_am, base, u_shift, bstride, offs_n, nmask, k_lo,
                                  tl.minimum(k_lo + slice_k, K), DUAL, INTERP, PREC, BLOCK_M, BLOCK_N, BLOCK_K)
            acc_g = acc_g + p_g
            if DUAL:
                acc_u = acc_u + p_u
        _epilogue(acc_g, acc_u, c_ptr, w_ptr, pairs, pmask, offs_n, cmask, stride_cm, act_ty, TOP_K, SLOTS, DUAL,
                  MUL_WEIGHT)


def tile(dual: bool, override: dict | None = None) -> dict:
    """The one tile (as the default op's tuned BLOCK_M = 64 tile; DUAL reads two slices, so half BLOCK_N).
    override: {"dual": cfg, "down": cfg} (benchmarks compare tiles; any fixed tile keeps the invariance)."""
    if override is not None:
        return override["dual" if dual else "down"]
    if interpreting():
        return {"BLOCK_N": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    return {"BLOCK_N": 64 if dual else 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}


def slice_k(k: int, slice_override: int | None = None) -> int:
    """The weight's K slice: a function of K alone (the interpreter's is 16 so its tiny K = 32 has two)."""
    if slice_override is not None:
        return slice_override
    return 16 if interpreting() else min(MOE_SLICE_K, triton.cdiv(k, 64) * 64)


def aligned_gemm(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, al: Alignment, block_m: int, top_k: int,
                 slots: int, a_div: int, shared_w: torch.Tensor | None = None,
                 topk_weights: torch.Tensor | None = None, dual: bool = False,
                 parallel: bool | None = None, slice_override: int | None = None,
                 tile_override: dict | None = None) -> None:
    """out[p] = a[p // a_div] @ W_expert(p)^T (* the pair's routing weight, 1.0 for a shared expert; fp32 out);
    dual: silu(gate) * up, out [pairs, N/2]. shared_w: the dense shared MLP's gate_up [2*S*I, D] (dual) or down
    [D, S*I] whose slices are experts E..E+S-1. parallel forces a schedule (None: the faster; the same bits)."""
    E, N, K = w.shape
    n_out = N // 2 if dual else N
    cfg = tile(dual, tile_override)
    sk = slice_k(K, slice_override)
    slices = triton.cdiv(K, sk)
    n_tiles = triton.cdiv(n_out, cfg["BLOCK_N"])
    tiles = al.num_blocks * n_tiles
    if parallel is None:  # at batch 1 (8 blocks x 22 column tiles) the split doubles the programs
        parallel = tiles < 2 * NUM_SMS
    parallel = parallel and slices > 1 and tiles <= COUNTERS
    num_shared = slots - top_k
    shared_w, stride_sn, shared_step, us_off = shared_layout(shared_w, w, dual, n_out, num_shared, K)
    rows = al.num_blocks * block_m
    if parallel:
        ws = torch.empty((slices, 2 if dual else 1, rows, n_out), dtype=torch.float32, device=a.device)
        cnt = tile_counters(a.device, tiles)
    else:
        ws = cnt = out
    grid = (al.num_blocks, n_tiles, slices if parallel else 1)
    _aligned_kernel[grid](
        a, w, shared_w, out, topk_weights if topk_weights is not None else a, al.sorted_ids, al.block_expert,
        al.block_rows, ws, cnt, n_out, K, E, sk, rows, n_out * w.stride(1), us_off, shared_step, a.stride(0),
        w.stride(0), w.stride(1), stride_sn, out.stride(0),
        TOP_K=top_k, SLOTS=slots, A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None, SLICES=slices,
        PARALLEL=parallel, PLANES=2 if dual else 1, INTERP=interpreting(),
        PREC="ieee" if a.dtype == torch.float32 else None,
        BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
