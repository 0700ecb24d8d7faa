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
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.errors import BackendError


@triton.jit
def _load_w(b_base, q_base, z_base, rows, kk, kmask, nmask, stride_bn, stride_qn, stride_qk,
            QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr, ACT: tl.constexpr):
    """The [BLOCK_K, BLOCK_N] weight tile B[rows, kk]^T, dequantized in registers when QUANT: 1 = fp8 e4m3 times
    its 128x128 block scale, 2 = fp4 e2m1 (two per byte, low nibble first) times its per-row per-32 scale (e8m0
    bytes when E8M0, else fp32), 3 = int4 AWQ / GPTQ (unsigned q two per byte, low nibble first) as
    (q - zero) * scale with a zero (uint8, z_base) and a scale per row per GROUP inputs. Dequantized in fp32 and
    rounded once to the activation dtype, as the native oracle densifies an expert (backend/native/moe.py
    dequant_expert)."""
    m = kmask[:, None] & nmask[None, :]
    # one constexpr branch is compiled (if / elif / else: an early return would not stop the compiler from
    # typing the branches after it against this scheme's pointer types)
    if QUANT == 0:
        out = tl.load(b_base + rows[None, :] * stride_bn + kk[:, None], mask=m, other=0.0)
    elif QUANT == 1:
        w = tl.load(b_base + rows[None, :] * stride_bn + kk[:, None], mask=m, other=0.0).to(tl.float32)
        sc = tl.load(q_base + (rows // 128)[None, :] * stride_qn + (kk // 128)[:, None] * stride_qk, mask=m, other=0.0)
        out = (w * sc).to(ACT)
    elif QUANT == 3:
        byte = tl.load(b_base + rows[None, :] * stride_bn + (kk // 2)[:, None], mask=m, other=0).to(tl.int32)
        q = ((byte >> ((kk % 2) * 4)[:, None]) & 0xF).to(tl.float32)
        g_off = rows[None, :] * stride_qn + (kk // GROUP)[:, None] * stride_qk
        zero = tl.load(z_base + g_off, mask=m, other=0).to(tl.float32)
        sc = tl.load(q_base + g_off, mask=m, other=0.0).to(tl.float32)
        out = ((q - zero) * sc).to(ACT)
    else:
        byte = tl.load(b_base + rows[None, :] * stride_bn + (kk // 2)[:, None], mask=m, other=0).to(tl.int32)
        nib = (byte >> ((kk % 2) * 4)[:, None]) & 0xF
        e = (nib >> 1) & 3
        man = (nib & 1).to(tl.float32)
        mag = tl.where(e == 0, man * 0.5, (1.0 + man * 0.5) * tl.exp2((e - 1).to(tl.float32)))
        val = tl.where((nib & 8) != 0, -mag, mag)
        sc = tl.load(q_base + rows[None, :] * stride_qn + (kk // 32)[:, None] * stride_qk, mask=m, other=0)
        if E8M0:
            sc = tl.exp2(sc.to(tl.float32) - 127.0)
        else:
            sc = sc.to(tl.float32)
        out = (val * sc).to(ACT)
    return out


@triton.jit
def _mainloop(a_ptr, rows, rmask, stride_am, b_base, u_off, offs_n, nmask, stride_bn, K,
              q_base, z_base, uq_off, stride_qn, stride_qk,
              DUAL: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
              QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc_g = A[rows] @ B[offs_n]^T (and acc_u with B's rows shifted by u_off when DUAL), fp32. Quantized B
    (QUANT) is dequantized tile by tile in registers (W8A16 / W4A16: Hopper has no fp4 tensor cores); u_off /
    uq_off then shift the weight bytes / the scale rows (and the int4 zeros, laid out as the scales) to the up
    projection."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    brows = offs_n.to(tl.int64)
    ACT = a_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = offs_k + k0
        kmask = kk < K
        a = tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = _load_w(b_base, q_base, z_base, brows, kk, kmask, nmask, stride_bn, stride_qn, stride_qk, QUANT, E8M0,
                    GROUP, ACT)
        if UPCAST:  # the interpreter's bf16 tl.dot is wrong (NOTES.md)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc_g += tl.dot(a, b, input_precision=PREC)
        if DUAL:
            u = _load_w(b_base + u_off, q_base + uq_off, z_base + uq_off, brows, kk, kmask, nmask, stride_bn,
                        stride_qn, stride_qk, QUANT, E8M0, GROUP, ACT)
            if UPCAST:
                u = u.to(tl.float32)
            acc_u += tl.dot(a, u, input_precision=PREC)
        a_ptrs += BLOCK_K
    return acc_g, acc_u


@triton.jit
def _epilogue(acc_g, acc_u, wv, ACT: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr):
    if DUAL:  # silu(gate) * up with the native op's roundings
        gate = acc_g.to(ACT).to(tl.float32)
        up = acc_u.to(ACT).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(ACT).to(tl.float32)
        return act * up
    if MUL_WEIGHT:  # round to the activation dtype first, then weight in fp32 (as the native op)
        return acc_g.to(ACT).to(tl.float32) * wv[:, None]
    return acc_g


@triton.jit
def _aligned_gemm_kernel(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, npad_ptr,
    N, K, num_pairs, u_off, stride_am, stride_be, stride_bn, stride_cm,
    q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk,
    A_DIV: tl.constexpr, DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr,
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
    acc_g, acc_u = _mainloop(a_ptr, rows, pmask, stride_am, b_ptr + expert * stride_be, u_off, offs_n, nmask,
                             stride_bn, K, q_ptr + expert * stride_qe, z_ptr + expert * stride_qe, uq_off, stride_qn,
                             stride_qk, DUAL, UPCAST, PREC, QUANT, E8M0, GROUP, BLOCK_M, BLOCK_N, BLOCK_K)
    if MUL_WEIGHT:
        wv = tl.load(w_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)
    else:
        wv = tl.zeros([BLOCK_M], dtype=tl.float32)
    out = _epilogue(acc_g, acc_u, wv, a_ptr.dtype.element_ty, DUAL, MUL_WEIGHT)
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, out.to(c_ptr.dtype.element_ty), mask=pmask[:, None] & nmask[None, :])


@triton.jit
def _direct_tile(a_ptr, b_ptr, bs_ptr, c_ptr, w_ptr, offs_q, match, expert, pid_n,
                 N, K, num_experts, u_off, us_off, shared_step, stride_am, stride_be, stride_bn, stride_sn, stride_cm,
                 q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk,
                 TOP_K: tl.constexpr, SLOTS: tl.constexpr, A_DIV: tl.constexpr,
                 DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
                 QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One expert's pairs (match), in pair order, compacted into BLOCK_M rows, times its BLOCK_N slice."""
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
    q_off = tl.minimum(expert, num_experts - 1).to(tl.int64) * stride_qe  # no shared expert when QUANT
    acc_g, acc_u = _mainloop(a_ptr, rows, pmask, stride_am, base, tl.where(shared, us_off, u_off), offs_n, nmask,
                             tl.where(shared, stride_sn, stride_bn), K, q_ptr + q_off, z_ptr + q_off, uq_off,
                             stride_qn, stride_qk, DUAL, UPCAST, PREC, QUANT, E8M0, GROUP, BLOCK_M, BLOCK_N, BLOCK_K)
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
    q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk,
    TOP_K: tl.constexpr, SLOTS: tl.constexpr, A_DIV: tl.constexpr,
    DUAL: tl.constexpr, MUL_WEIGHT: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
    QUANT: tl.constexpr, E8M0: tl.constexpr, GROUP: tl.constexpr,
    COMBINE: tl.constexpr, HAS_SHARED: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
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
                     stride_cm, q_ptr, z_ptr, uq_off, stride_qe, stride_qn, stride_qk, TOP_K, SLOTS, A_DIV, DUAL,
                     MUL_WEIGHT, UPCAST, PREC, QUANT, E8M0, GROUP, BLOCK_M, BLOCK_N, BLOCK_K)
    if COMBINE:  # down projection: the [T, D] output in this launch, no combine kernel
        _last_program_combines(c_ptr, out_ptr, s_ptr, cnt_ptr, pid_n, num_pairs, num_pairs // SLOTS, N,
                               stride_cm, stride_o, stride_s, SLOTS, HAS_SHARED, BLOCK_M, BLOCK_N)


def interpreting() -> bool:
    return envs.TRITON_INTERPRET.get() == "1"


def _tile_env(name: str) -> dict | None:
    """DEEPINFER_MOE_TILE / DEEPINFER_MOE_DIRECT_TILE (`name`), parsed; None when unset."""
    env = envs.BY_NAME[name].get()
    if not env:
        return None
    try:
        bn, bk, warps, stages = (int(v) for v in env.split(","))
    except ValueError:
        raise BackendError(f"{name} must be 'BLOCK_N,BLOCK_K,num_warps,num_stages', got {env!r}") from None
    return {"block_n": bn, "block_k": bk, "num_warps": warps, "num_stages": stages}


def gemm_config(block_m: int, dual: bool = False) -> dict:
    """Aligned tile per BLOCK_M; DEEPINFER_MOE_TILE="BN,BK,warps,stages" overrides it (for tuning runs).

    DUAL programs read two BN-row weight slices, so they take BN/2: the same
    weight bytes per program (and shared memory) as the tuned single tile.
    """
    if interpreting():
        return {"block_n": 16 if dual else 32, "block_k": 16, "num_warps": 4, "num_stages": 1}
    cfg = _tile_env("DEEPINFER_MOE_TILE")
    if cfg is None:
        if block_m <= 32:  # decode: H200 sweep (docs/perf-log/2026-11-29-first-h200-baseline.md): all tiles within ~10%, this one best at 1 token
            cfg = {"block_n": 128, "block_k": 128, "num_warps": 8, "num_stages": 3}
        else:
            cfg = {"block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 3}
    if dual:
        cfg = dict(cfg, block_n=max(16, cfg["block_n"] // 2))
    return cfg


def direct_config(dual: bool) -> dict:
    """Direct-mode tile; DEEPINFER_MOE_DIRECT_TILE="BN,BK,warps,stages" overrides it (BN counts both halves
    of a DUAL program: 128 = 64 gate + 64 up rows)."""
    if interpreting():
        return {"block_n": 16 if dual else 32, "block_k": 16, "num_warps": 4, "num_stages": 1}
    cfg = _tile_env("DEEPINFER_MOE_DIRECT_TILE") or {"block_n": 64, "block_k": 128, "num_warps": 4, "num_stages": 4}
    if dual:
        cfg = dict(cfg, block_n=max(16, cfg["block_n"] // 2))
    return cfg


QUANT_CODES = {None: 0, "fp8_block": 1, "fp4": 2, "int4_awq": 3, "int4_gptq": 3}
PACKED = (2, 3)  # two 4-bit values per byte along K


def _quant_args(w: torch.Tensor, scale: torch.Tensor | None, scheme: str | None, dual: bool, n_out: int,
                zeros: torch.Tensor | None = None):
    """(K, scale tensor, zeros tensor, uq_off, (stride_qe, stride_qn, stride_qk), QUANT, E8M0) for a weight of
    `scheme`: the logical K (fp4 / int4 pack two per byte), and the up projection's scale offset (fp8: the gate
    grid's rows, fp4 / int4: I rows) for a DUAL weight. int4's zeros are laid out as its scales (same offsets)."""
    if scheme not in QUANT_CODES:
        raise BackendError(f"MoE grouped GEMM: weight scheme {scheme!r} (known: fp8_block, fp4, int4_awq, int4_gptq)")
    if scheme is None:
        return w.shape[2], w, w, 0, (0, 0, 0), 0, False
    if scale is None or scale.dim() != 3 or scale.shape[0] != w.shape[0]:
        raise BackendError(f"MoE grouped GEMM: {scheme} weights need a [E, rows, cols] scale")
    code = QUANT_CODES[scheme]
    if code == 3:
        if zeros is None or zeros.shape != scale.shape or zeros.stride() != scale.stride() or zeros.dtype != torch.uint8:
            raise BackendError(f"MoE grouped GEMM: {scheme} weights need uint8 zeros of the scale's shape and strides")
    else:
        zeros = scale  # never read
    k = w.shape[2] * (2 if code in PACKED else 1)
    uq = 0
    if dual:
        uq = (scale.shape[1] // 2 if scheme == "fp8_block" else n_out) * scale.stride(1)
    return (k, scale, zeros, uq, (scale.stride(0), scale.stride(1), scale.stride(2)), code,
            scale.dtype == torch.uint8)


def _prec(dtype: torch.dtype):
    return "ieee" if dtype == torch.float32 else None  # fp32 tl.dot defaults to TF32 on the GPU


def aligned_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
    num_padded: torch.Tensor, num_pairs: int, a_div: int, block_m: int, topk_weights: torch.Tensor | None = None,
    dual: bool = False, scale: torch.Tensor | None = None, scheme: str | None = None,
    zeros: torch.Tensor | None = None, group_size: int = 128,
) -> None:
    """out[p] = a[p // a_div] @ w[expert(p)]^T (* topk_weights[p]); dual: silu(gate) * up, out [pairs, N/2].
    scheme "fp8_block" / "fp4" / "int4_*": w, scale (and int4 zeros, group_size) as QuantizedExperts holds them,
    dequantized in the inner loop."""
    E, N, _ = w.shape
    n_out = N // 2 if dual else N
    K, q, z, uq_off, (sqe, sqn, sqk), quant, e8m0 = _quant_args(w, scale, scheme, dual, n_out, zeros)
    cfg = gemm_config(block_m, dual)
    grid = (expert_ids.shape[0], triton.cdiv(n_out, cfg["block_n"]))
    _aligned_gemm_kernel[grid](
        a, w, out, topk_weights if topk_weights is not None else a, sorted_ids, expert_ids, num_padded,
        n_out, K, num_pairs, n_out * w.stride(1), a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        q, z, uq_off, sqe, sqn, sqk,
        A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None,
        UPCAST=interpreting() and a.dtype == torch.bfloat16, PREC=_prec(a.dtype), QUANT=quant, E8M0=e8m0,
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def direct_gemm(
    a: torch.Tensor, w: torch.Tensor, shared_w: torch.Tensor | None, out: torch.Tensor, topk_ids: torch.Tensor,
    topk_weights: torch.Tensor | None, num_shared: int, a_div: int, dual: bool,
    combine_into: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None,
    scale: torch.Tensor | None = None, scheme: str | None = None, zeros: torch.Tensor | None = None,
    group_size: int = 128,
) -> None:
    """Direct mode over the T * (k + num_shared) pairs (pair = token * slots + slot).

    dual (gate_up): a = x [T, D], w [E, 2I, D], shared_w [2*S*I, D] -> out [pairs, I] = silu(gate) * up.
    down: a = act [pairs, I], w [E, D, I], shared_w [D, S*I] -> out [pairs, D] fp32, routed rows weighted;
    with combine_into = (final [T, D], shared output [T, D] or None, counters int32 zeros) the last program
    of each column also writes final (as fused_moe.combine), saving the combine launch.
    """
    T, top_k = topk_ids.shape
    E, N, _ = w.shape
    slots = top_k + num_shared
    num_pairs = T * slots
    n_out = N // 2 if dual else N
    K, q, z, uq_off, (sqe, sqn, sqk), quant, e8m0 = _quant_args(w, scale, scheme, dual, n_out, zeros)
    if quant and shared_w is not None:
        raise BackendError("direct_gemm: shared experts fold in only with dense routed experts")
    if shared_w is None:
        shared_w, stride_sn, shared_step, us_off = w, 0, 0, 0
    elif dual:  # [2*S*I, D]: shared expert s has gate rows s*I.., up rows S*I + s*I..
        stride_sn = shared_w.stride(0)
        shared_step, us_off = n_out * stride_sn, num_shared * n_out * stride_sn
    else:  # [D, S*I]: shared expert s is the column slice [s*I, (s+1)*I)
        stride_sn, shared_step, us_off = shared_w.stride(0), K, 0
    cfg = direct_config(dual)
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
        shared_out.stride(0) if shared_out is not None else 0, q, z, uq_off, sqe, sqn, sqk,
        TOP_K=top_k, SLOTS=slots, A_DIV=a_div, DUAL=dual, MUL_WEIGHT=topk_weights is not None,
        UPCAST=interpreting() and a.dtype == torch.bfloat16, PREC=_prec(a.dtype), QUANT=quant, E8M0=e8m0,
        GROUP=group_size, COMBINE=combine_into is not None, HAS_SHARED=shared_out is not None,
        BLOCK_P=triton.next_power_of_2(num_pairs), BLOCK_M=block_m, BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
