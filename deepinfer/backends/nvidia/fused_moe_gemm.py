"""The MoE grouped GEMMs in Triton: an expert-sorted ("aligned") kernel and a small-batch "direct" one.

Both multiply the rows of the (token, slot) pairs routed to one expert by a
BLOCK_N slice of that expert's weights, so an expert tile is read once per
block of its pairs. Two epilogues:

- DUAL (gate_up): the program accumulates the gate rows [n0, n0+BN) and the
  matching up rows [I+n0, I+n0+BN) and writes silu(gate) * up ([pairs, I]),
  rounding gate, up and silu(gate) to the activation dtype as the native op
  (F.linear, F.silu, *) does; no [pairs, 2I] round trip, no SiLU launch.
- MUL_WEIGHT (down): the result is rounded to the activation dtype, then
  multiplied by the routing weight in fp32 (as the native op), stored fp32.

The aligned kernel reads moe_align's layout (sorted pair ids padded per
expert to BLOCK_M). The direct kernel needs no alignment kernel: program
(p, n) takes pair p's expert, exits unless p is that expert's first pair,
and gathers every pair of that expert itself (at most BLOCK_M >= T, since a
token picks an expert at most once). Shared experts folded in are experts
E..E+S-1 taken by every token with weight 1.0, their weights read in place
from the dense shared MLP (gate_up [2*S*I, D], down [D, S*I]). With COMBINE
the last program of each down-GEMM column (a per-column counter) also sums
the slots into the [T, D] output, so small batches need no combine launch.

Weight schemes and activation modes (dense / W8A16 / W4A16 / fp8 W8A8) are fused_moe_mainloop.py's; the
tiles and per-scheme arguments fused_moe_config.py's. Under fp8 activations ("fp8_w8a8") the aligned gate_up
writes its output as e4m3 + per-128-channel scales (ACT_FP8_OUT), which the down GEMM reads as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.fused_moe_config import (  # noqa: F401  (interpreting, _tile_env: re-exported)
    FP8_ACT,
    _tile_env,
    block_p,
    direct_config,
    gemm_config,
    gidx_args,
    gidx_config,
    interpreting,
    prec,
    quant_args,
)
from deepinfer.backends.nvidia.fused_moe_gemv import int4_gemv
from deepinfer.backends.nvidia.fused_moe_mainloop import _epilogue, _mainloop, _store_fp8_rows
from deepinfer.backends.nvidia.quant.tiles import TL_DTYPES
from deepinfer.errors import BackendError


@triton.jit
def _tile_order(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program pid. GROUP_M 0: row tiles first (pid_m = pid % num_m), so each column
    tile of an expert's weights is read by that expert's row tiles one after another, and every row tile's
    activations are read again for each column tile, num_m programs later (out of the L2 by then at prefill sizes:
    at 16,384 tokens V2-Lite's gate_up re-reads ~200 MB of e4m3 rows 11 times). GROUP_M > 0 (DEEPINFER_MOE_GROUP_M,
    8 by default): groups of GROUP_M row tiles run all their column tiles before the next group (the dense GEMMs'
    grouped order), so a group's rows stay in the L2 across its column tiles and each weight tile is read once per
    group instead. Measured on an H100 (2026-12-05, benchmarks/quant_gemm.py --only moe, whole fused_moe): at 16,384
    tokens bf16 3,911 -> 3,591 us, fp8 W8A8 3,975 -> 3,344 us; at 4,096 1,628 -> 1,476 and 1,143 -> 1,009 us; at
    256 within 2%."""
    if GROUP_M == 0:
        pid_m = pid % num_m
        pid_n = pid // num_m
    else:
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        size_m = tl.minimum(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
    return pid_m, pid_n


@triton.jit
def _aligned_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, npad_ptr,
    N, K, num_pairs, u_off, stride_am, stride_be, stride_bn, stride_cm,
    q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk, g_ptr, stride_ge,
    as_ptr, stride_as, cs_ptr, stride_cs,
    A_DIV: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, GIDX: tl.constexpr, A_MODE: tl.constexpr,
    ACT_FP8_OUT: tl.constexpr,
    ROUND_FIRST: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, num_m, GROUP_M: tl.constexpr,
):
    pid_m, pid_n = _tile_order(tl.program_id(0), num_m, tl.cdiv(N, BLOCK_N), GROUP_M)
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
    acc_g, acc_u = _mainloop(a_ptr, as_ptr, stride_as, rows, pmask, stride_am, b_ptr + expert * stride_be, u_off,
                             offs_n, nmask, stride_bn, K, q_ptr + expert * stride_qe, z_ptr + expert * stride_qe,
                             uq_off, stride_qn, stride_qk, g_ptr + expert * stride_ge, DUAL, UPCAST, PREC, QUANT, E8M0,
                             GROUP, GIDX, A_MODE, ROUND_FIRST, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
    if MUL_WEIGHT:
        wv = tl.load(w_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)
    else:
        wv = tl.zeros([BLOCK_M], dtype=tl.float32)
    out = _epilogue(acc_g, acc_u, wv, ACT, DUAL, MUL_WEIGHT)
    if ACT_FP8_OUT:  # gate_up under W8A8: e4m3 + per-128 scales for the down GEMM
        _store_fp8_rows(out, pairs, pmask, offs_n, nmask, c_ptr, cs_ptr, stride_cm, stride_cs, pid_n, ACT,
                        ROUND_FIRST)
    else:
        c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _direct_tile(a_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, offs_q, match, expert, pid_n,
                 N, K, num_experts, u_off, us_off, shared_step, stride_am, stride_be, stride_bn, stride_sn, stride_cm,
                 q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk, g_ptr, stride_ge,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, A_DIV: tl.constexpr,
                 DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, GIDX: tl.constexpr, A_MODE: tl.constexpr,
                 ROUND_FIRST: tl.constexpr, SHARED_STACKED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr,
                 GEMV: tl.constexpr):
    """One expert's pairs (match), in pair order, compacted into BLOCK_M rows, times its BLOCK_N slice. GEMV (int4,
    one token: each expert has one pair): fused_moe_gemv.int4_gemv on that row, the tile's other rows zero."""
    rank = tl.cumsum(match.to(tl.int32), 0) - 1
    offs_m = tl.arange(0, BLOCK_M)
    sel = match[None, :] & (rank[None, :] == offs_m[:, None])
    pairs = tl.sum(tl.where(sel, offs_q[None, :], 0), 1)
    pmask = tl.sum(sel.to(tl.int32), 1) > 0
    rows = (pairs // A_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    shared = expert >= num_experts
    base = tl.where(shared, bs_ptr + tl.maximum(expert - num_experts, 0).to(tl.int64) * shared_step,
                    b_ptr + tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_be)
    if SHARED_STACKED:  # quantized shared experts sit after the routed ones in the same tensors
        q_off = expert.to(tl.int64) * stride_qe
    else:  # dense shared experts carry no scale
        q_off = tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_qe
    if GEMV:
        first = offs_m == 0
        g, u = int4_gemv(a_ptr, tl.sum(tl.where(first, rows, 0), 0), stride_am, base,
                         tl.where(shared, us_off, u_off), offs_n, nmask, tl.where(shared, stride_sn, stride_bn), K,
                         q_ptr + q_off, z_ptr + q_off, uq_off, stride_qn, stride_qk, DUAL, GROUP, BLOCK_N, BLOCK_K)
        acc_g = tl.where(first[:, None], g[None, :], 0.0)
        acc_u = tl.where(first[:, None], u[None, :], 0.0)
    else:
        # (GIDX: routed experts only, no shared experts stacked: direct_gemm checks)
        g_base = g_ptr + tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_ge
        acc_g, acc_u = _mainloop(a_ptr, a_ptr, 0, rows, pmask, stride_am, base, tl.where(shared, us_off, u_off),
                                 offs_n, nmask, tl.where(shared, stride_sn, stride_bn), K, q_ptr + q_off,
                                 z_ptr + q_off, uq_off, stride_qn, stride_qk, g_base, DUAL, UPCAST, PREC, QUANT, E8M0,
                                 GROUP, GIDX, A_MODE, ROUND_FIRST, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB)
    if MUL_WEIGHT:  # routed slots carry their routing weight, shared experts 1.0
        p_slot = pairs % SLOTS
        p_routed = p_slot < TOP_K
        wv = tl.load(w_ptr + (pairs // SLOTS) * TOP_K + p_slot, mask=pmask & p_routed, other=0.0)
        wv = tl.where(p_routed, wv.to(tl.float32), 1.0)
    else:
        wv = tl.zeros([BLOCK_M], dtype=tl.float32)
    out = _epilogue(acc_g, acc_u, wv, a_ptr.dtype.element_ty, DUAL, MUL_WEIGHT)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _last_program_combines(c_ptr, out_ptr, s_ptr, cnt_ptr, pid_n, num_programs, num_tokens, N,
                           stride_cm, stride_o, stride_s,
                           SLOTS: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_T: tl.constexpr,
                           BLOCK_N: tl.constexpr):
    """Serial reduction: the last program to finish a BLOCK_N column sums its slots (the combine kernel's
    arithmetic, slot order: deterministic) and resets the column's counter for the next launch. All
    tokens at once ([BLOCK_T, BLOCK_N] tiles, SLOTS independent loads): one L2 round trip of tail."""
    tl.debug_barrier()  # all threads' tile stores happen before the (acq_rel, gpu-scope) counter increment
    done = tl.atomic_add(cnt_ptr + pid_n, 1)
    if done == num_programs - 1:  # [T, D] with T <= 64 tokens in direct mode: int32 offsets suffice
        offs_t = tl.arange(0, BLOCK_T)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (offs_t < num_tokens)[:, None] & (offs_n < N)[None, :]
        ty = out_ptr.dtype.element_ty
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for j in tl.static_range(SLOTS):
            rows = offs_t * SLOTS + j
            acc += tl.load(c_ptr + rows[:, None] * stride_cm + offs_n[None, :], mask=mask, other=0.0,
                           cache_modifier=".cg")  # L2: other programs' tiles, not a stale L1 line
        if HAS_SHARED:
            sh = tl.load(s_ptr + offs_t[:, None] * stride_s + offs_n[None, :], mask=mask, other=0.0)
            acc = acc.to(ty).to(tl.float32) + sh.to(tl.float32)
        tl.store(out_ptr + offs_t[:, None] * stride_o + offs_n[None, :], acc.to(ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + pid_n, 0)


@triton.jit
def _direct_gemm_kernel(
    a_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, ids_ptr, out_ptr, s_ptr, cnt_ptr,
    N, K, num_pairs, num_experts, u_off, us_off, shared_step,
    stride_am, stride_be, stride_bn, stride_sn, stride_cm, stride_o, stride_s,
    q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk, g_ptr, stride_ge,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, A_DIV: tl.constexpr,
    DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, GIDX: tl.constexpr, A_MODE: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    SHARED_STACKED: tl.constexpr, COMBINE: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP_AB: tl.constexpr, GEMV: tl.constexpr,
):
    pid_p = tl.program_id(0)
    pid_n = tl.program_id(1)
    # every pair's expert: slot < TOP_K reads topk_ids, slot TOP_K + s is shared expert E + s
    offs_q = tl.arange(0, BLOCK_P)
    qmask = offs_q < num_pairs
    slot = offs_q % SLOTS
    routed = slot < TOP_K
    ids = tl.load(ids_ptr + (offs_q // SLOTS) * TOP_K + slot, mask=qmask & routed, other=0).to(tl.int32)
    ids = tl.where(routed, ids, num_experts + slot - TOP_K)
    ids = tl.where(qmask, ids, -1)
    expert = tl.sum(tl.where(offs_q == pid_p, ids, 0), 0)
    match = ids == expert
    # else an earlier pair's program has this expert; a -1 id (another rank's expert) is nobody's work
    if (tl.min(tl.where(match, offs_q, BLOCK_P), 0) == pid_p) & (expert >= 0):
        _direct_tile(a_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, offs_q, match, expert, pid_n,
                     N, K, num_experts, u_off, us_off, shared_step, stride_am, stride_be, stride_bn, stride_sn,
                     stride_cm, q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk, g_ptr, stride_ge, TOP_K, SLOTS,
                     A_DIV, DUAL, MUL_WEIGHT, UPCAST, PREC, QUANT, E8M0, GROUP, GIDX, A_MODE, ROUND_FIRST,
                     SHARED_STACKED, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, GEMV)
    if COMBINE:  # down projection: the [T, D] output in this launch, no combine kernel
        _last_program_combines(c_ptr, out_ptr, s_ptr, cnt_ptr, pid_n, num_pairs, num_pairs // SLOTS, N,
                               stride_cm, stride_o, stride_s, SLOTS, HAS_SHARED, BLOCK_M, BLOCK_N)


def _a_mode(scheme: str | None, a: torch.Tensor, a_scale: torch.Tensor | None) -> int:
    """0: A in the compute dtype (dense / W8A16 / W4A16); 1: A e4m3 with a_scale; 2: quantized on load."""
    if scheme not in FP8_ACT:
        if a_scale is not None:
            raise BackendError(f"MoE grouped GEMM: activation scales given for {scheme or 'dense'} weights")
        return 0
    if a_scale is None:
        return 2
    if a.dtype != torch.float8_e4m3fn or a_scale.dtype != torch.float32 or a_scale.shape[0] != a.shape[0] \
            or a_scale.shape[1] != triton.cdiv(a.shape[1], 128):
        raise BackendError(f"MoE grouped GEMM: W8A8 activations {tuple(a.shape)} {a.dtype} with scales "
                           f"{tuple(a_scale.shape)} {a_scale.dtype}: expected e4m3 [rows, K] and fp32 [rows, K/128]")
    return 1


def _swap_ab(cfg: dict, a_mode: int) -> bool:
    """cfg["swap_ab"]: run the W8A8 products as B @ A^T (fused_moe_mainloop._fp8_step_swapped); only fp8
    activations (A_MODE 1 / 2) have that path."""
    swap = bool(cfg.get("swap_ab", False))
    if swap and a_mode == 0:
        raise BackendError("MoE grouped GEMM: swap_ab is a tile option of fp8 W8A8 weights only")
    return swap


def use_int4_gemv(cfg: dict, quant: int, num_tokens: int) -> bool:
    """The direct int4 GEMMs at one token take the GEMV mainloop (fused_moe_gemv.py) when cfg["gemv"] says so (tile
    sweeps) or, without that key, DEEPINFER_INT4_GEMV (off by default: not measured on a GPU yet). One token
    only: each expert then has exactly one pair."""
    want = cfg.get("gemv")
    if want and quant != 3:
        raise BackendError("MoE direct GEMM: the GEMV mainloop is int4's (AWQ / GPTQ) only")
    if want is None:
        want = quant == 3 and envs.INT4_GEMV.get()
    return bool(want) and num_tokens == 1


def aligned_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_padded: torch.Tensor, num_pairs: int, a_div: int, block_m: int, topk_weights: torch.Tensor | None = None,
    dual: bool = False, scale: torch.Tensor | None = None, scheme: str | None = None,
    zeros: torch.Tensor | None = None, group_size: int = 128, a_scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None, act_dtype: torch.dtype | None = None, cfg: dict | None = None,
    g_idx: torch.Tensor | None = None, perm: torch.Tensor | None = None,
) -> None:
    """out[p] = a[p // a_div] @ w[expert(p)]^T (* topk_weights[p]); dual: silu(gate) * up, out [pairs, N/2].
    scheme "fp8_block" / "fp4" / "int4_*": w, scale (and int4 zeros, group_size) as QuantizedExperts holds them,
    dequantized in the inner loop. "fp8_w8a8": a is e4m3 with a_scale [rows, K/128] (or, without a_scale, the
    compute dtype quantized on load); a dual out is then e4m3 with out_scale [pairs, N/2/128]. act_dtype: the
    compute dtype the epilogue rounds to (default a's). cfg: a tile for benchmark sweeps. g_idx: int4 GPTQ
    act-order, int32 [E, K], each input channel's group (fused_moe_config.gidx_args). perm: int4 act-order weights
    whose columns were sorted by group at load, int32 [E, K], the input channel of each column (quant/act_order.py):
    a's columns are gathered through it."""
    E, N, _ = w.shape
    n_out = N // 2 if dual else N
    K, q, z, uq_off, (sqe, sqn, sqk), quant, e8m0 = quant_args(w, scale, scheme, dual, n_out, zeros)
    if a.shape[1] != K:
        raise BackendError(f"aligned_gemm: activations have {a.shape[1]} features, the weights {K}")
    gidx = _gidx_mode(g_idx, perm, "aligned_gemm")
    gp, sge = gidx_args(g_idx if perm is None else perm, quant, E, K, q, "aligned_gemm")
    a_mode = _a_mode(scheme, a, a_scale)
    act = act_dtype or a.dtype
    fp8_out = out_scale is not None
    if fp8_out and not (dual and scheme in FP8_ACT and out.dtype == torch.float8_e4m3fn
                        and tuple(out_scale.shape) == (out.shape[0], triton.cdiv(n_out, 128))):
        raise BackendError("aligned_gemm: an e4m3 output with per-128 scales is the W8A8 gate_up's only")
    if cfg is None:
        cfg = gemm_config(block_m, dual, scheme, group_size)
        cfg = gidx_config(cfg) if g_idx is not None else cfg
    swap = _swap_ab(cfg, a_mode)
    if fp8_out and cfg["block_n"] != 128:
        raise BackendError(f"aligned_gemm: the e4m3 gate_up output needs BLOCK_N 128, got {cfg['block_n']}")
    num_m = expert_ids.shape[0]
    group_m = cfg.get("group_m", envs.MOE_GROUP_M.get())
    _aligned_gemm_kernel[(num_m * triton.cdiv(n_out, cfg["block_n"]),)](
        a, w, out, topk_weights if topk_weights is not None else a, sorted_ids, expert_ids, num_padded,
        n_out, K, num_pairs, n_out * w.stride(1), a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        q, z, uq_off, sqe, sqn, sqk, gp, sge, a_scale if a_scale is not None else q,
        a_scale.stride(0) if a_mode == 1 else 0, out_scale if fp8_out else q, out_scale.stride(0) if fp8_out else 0,
        A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None,
        UPCAST=interpreting() and a.dtype == torch.bfloat16, PREC=prec(act), QUANT=quant, E8M0=e8m0,
        GROUP=group_size, GIDX=gidx, A_MODE=a_mode, ACT_FP8_OUT=fp8_out, ROUND_FIRST=interpreting(), ACT=TL_DTYPES[act],
        BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SWAP_AB=swap, num_m=num_m,
        GROUP_M=group_m, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _gidx_mode(g_idx: torch.Tensor | None, perm: torch.Tensor | None, what: str) -> int:
    """The kernels' GIDX: 0 contiguous groups, 1 groups gathered per input channel (g_idx), 2 columns sorted by group
    at load and A gathered through perm (fused_moe_mainloop._mainloop)."""
    if g_idx is not None and perm is not None:
        raise BackendError(f"{what}: g_idx (weights in input order) and perm (weights sorted by group) are two "
                           "layouts of act-order weights; give one")
    return 1 if g_idx is not None else 2 if perm is not None else 0


def shared_layout(shared_w: torch.Tensor | None, w: torch.Tensor, dual: bool, n_out: int, num_shared: int,
                  k: int) -> tuple[torch.Tensor, int, int, int]:
    """(the tensor, row stride, step between shared experts, up-half offset) a grouped GEMM reads the dense shared
    MLP's weights with (the default direct mode and the invariant aligned mode alike): none (w stands in, never
    read), gate_up [2*S*I, D] (dual: shared expert s has gate rows s*I.., up rows S*I + s*I..) or down [D, S*I]
    (shared expert s is the column slice [s*I, (s+1)*I))."""
    if shared_w is None:
        return w, 0, 0, 0
    if dual:
        stride = shared_w.stride(0)
        return shared_w, stride, n_out * stride, num_shared * n_out * stride
    return shared_w, shared_w.stride(0), k, 0


def direct_gemm(
    a: torch.Tensor, w: torch.Tensor, shared_w: torch.Tensor | None, out: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None, num_shared: int, a_div: int, dual: bool,
    combine_into: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
    scale: torch.Tensor | None = None, scheme: str | None = None, zeros: torch.Tensor | None = None,
    group_size: int = 128, cfg: dict | None = None, stacked_shared: bool = False, g_idx: torch.Tensor | None = None,
    perm: torch.Tensor | None = None,
) -> None:
    """Direct mode over the T * (k + num_shared) pairs (pair = token * slots + slot).

    dual (gate_up): a = x [T, D], w [E, 2I, D], shared_w [2*S*I, D] -> out [pairs, I] = silu(gate) * up.
    down: a = act [pairs, I], w [E, D, I], shared_w [D, S*I] -> out [pairs, D] fp32, routed rows weighted;
    with combine_into = (final [T, D], shared output [T, D] or None, counters int32 zeros) the last program
    of each column also writes final (as fused_moe.combine), saving the combine launch. "fp8_w8a8" weights:
    a (the compute dtype) is quantized per row per 128 channels as it is loaded. stacked_shared: quantized routed
    experts whose w / scale / zeros hold the num_shared shared experts after the E routed ones (shared_w None).
    g_idx: int4 GPTQ act-order, int32 [E, K], each input channel's group (fused_moe_config.gidx_args; no stacked
    shared experts). perm: act-order weights with columns sorted by group, int32 [E, K] (aligned_gemm; no stacked
    shared experts either).
    """
    T, top_k = topk_ids.shape
    E, N, _ = w.shape
    if stacked_shared:
        if shared_w is not None or not num_shared:
            raise BackendError("direct_gemm: stacked shared experts come in w itself (num_shared > 0, no shared_w)")
        E -= num_shared
    slots = top_k + num_shared
    num_pairs = T * slots
    n_out = N // 2 if dual else N
    K, q, z, uq_off, (sqe, sqn, sqk), quant, e8m0 = quant_args(w, scale, scheme, dual, n_out, zeros)
    if a.shape[1] != K:
        raise BackendError(f"direct_gemm: activations have {a.shape[1]} features, the weights {K}")
    if quant and shared_w is not None:
        raise BackendError("direct_gemm: shared experts fold in only with dense routed experts")
    if (g_idx is not None or perm is not None) and stacked_shared:
        raise BackendError("direct_gemm: act-order g_idx with stacked shared experts (they are not folded then)")
    gidx = _gidx_mode(g_idx, perm, "direct_gemm")
    gp, sge = gidx_args(g_idx if perm is None else perm, quant, E, K, q, "direct_gemm")
    if stacked_shared:  # shared expert s is w[E + s]: the routed experts' strides and up offset
        shared_w, stride_sn, shared_step, us_off = w[E:], w.stride(1), w.stride(0), n_out * w.stride(1)
    else:
        shared_w, stride_sn, shared_step, us_off = shared_layout(shared_w, w, dual, n_out, num_shared, K)
    if cfg is None:
        cfg = direct_config(dual, scheme, group_size)
        cfg = gidx_config(cfg) if g_idx is not None else cfg
    a_mode = _a_mode(scheme, a, None)
    swap = _swap_ab(cfg, a_mode)
    gemv = use_int4_gemv(cfg, quant, T) and not gidx  # (the GEMV mainloop reads contiguous groups, x in order)
    block_m = max(16, triton.next_power_of_2(T))
    grid = (num_pairs, triton.cdiv(n_out, cfg["block_n"]))
    final, shared_out, counters = combine_into if combine_into is not None else (out, None, out)
    if combine_into is not None and (dual or counters.numel() < grid[1] or counters.dtype != torch.int32):
        raise BackendError(f"direct_gemm: the fused combine needs the down GEMM and >= {grid[1]} int32 counters")
    _direct_gemm_kernel[grid](
        a, w, shared_w, out, topk_weights if topk_weights is not None else a, topk_ids,
        final, shared_out if shared_out is not None else final, counters,
        n_out, K, num_pairs, E, n_out * w.stride(1), us_off, shared_step,
        a.stride(0), w.stride(0), w.stride(1), stride_sn, out.stride(0), final.stride(0),
        shared_out.stride(0) if shared_out is not None else 0, q, z, uq_off, sqe, sqn, sqk, gp, sge,
        TOP_K=top_k, SLOTS=slots, A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None,
        UPCAST=interpreting() and a.dtype == torch.bfloat16, PREC=prec(a.dtype), QUANT=quant, E8M0=e8m0,
        GROUP=group_size, GIDX=gidx, A_MODE=a_mode, ROUND_FIRST=interpreting(), SHARED_STACKED=stacked_shared,
        COMBINE=combine_into is not None, HAS_SHARED=shared_out is not None,
        BLOCK_P=block_p(num_pairs), BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"], SWAP_AB=swap,
        GEMV=gemv,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
