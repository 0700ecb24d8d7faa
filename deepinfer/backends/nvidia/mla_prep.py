"""MLA pre-attention in one Triton kernel: latent RMSNorm + RoPE on k_pe and q_pe + paged KV-cache write.

The model's kv_a projection row is [kv_c (L) | k_pe (R)] and q is [T, H, nope + R].
Done op by op this is an RMSNorm, two `.contiguous()` copies, a RoPE kernel, a
concatenation and a KV write: six launches of a few microseconds each at batch
1. Here one program per token normalises kv_c, rotates k_pe and writes both
into the token's cache slot (slot -1, a padded row, writes nothing), and rotates
that token's q_pe of every head in place in q, where the attention reads it.
For decode, the same launch can also absorb q_nope through W_UK (extra
programs, one per 16 tokens x head x 128 latent columns, fp32 accumulation as
the batched GEMM it replaces), so the decode kernel reads q_lat directly.

Rounding follows the separate ops exactly (so the model's numerics do not move):
RMSNorm in fp32, rounded to the input dtype, times the weight in fp32, rounded;
RoPE in fp32 with the fp32 cos/sin table (YaRN factors included), rounded.
An fp8 cache then stores those rounded values divided by the layer's scale, clamped to ±448, in e4m3
(kv_fp8.fp8_e4m3_value: the torch reference's quantize_kv, bit for bit).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs
from deepinfer.backends.nvidia.kv_fp8 import fp8_e4m3_value


@triton.jit
def _absorb_block(q_ptr, wuk_ptr, qlat_ptr, a, T, H, stride_qt, stride_qh, stride_wh, stride_wn, stride_lt, stride_lh,
                  NOPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                  NUM_C: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr):
    """q_lat[tokens, h, columns] = q_nope[tokens, h] @ W_UK[h][:, columns] for one (token block, head, column block)."""
    c = a % NUM_C
    h = (a // NUM_C) % H
    tb = a // (NUM_C * H)
    toks = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    tm = toks < T
    offs_n = tl.arange(0, BLOCK_K)
    nm = offs_n < NOPE
    qn = tl.load(q_ptr + toks[:, None] * stride_qt + h * stride_qh + offs_n[None, :], mask=tm[:, None] & nm[None, :],
                 other=0.0)
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
    w = tl.load(wuk_ptr + h * stride_wh + offs_n[:, None] * stride_wn + offs_c[None, :], mask=nm[:, None], other=0.0)
    if UPCAST:  # the interpreter: fp64 products, rounded to fp32 once (its numpy tl.dot rounds a tile's edge rows
        # unlike its inner rows, so a token's bits would follow its place in the 16-token tile; invariant/gemm.mma)
        acc = tl.dot(qn.to(tl.float64), w.to(tl.float64)).to(tl.float32)
    else:
        acc = tl.dot(qn, w, input_precision=PREC)  # fp32 accumulation, rounded once: as the batched GEMM
    tl.store(qlat_ptr + toks[:, None] * stride_lt + h * stride_lh + offs_c[None, :],
             acc.to(qlat_ptr.dtype.element_ty), mask=tm[:, None])


@triton.jit
def _prep_token(
    q_ptr, kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, tok, H, stride_qt, stride_qh, stride_kvt, stride_cs,
    eps, kv_scale, L: tl.constexpr, BLOCK_L: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr,
    SCALED: tl.constexpr,
):
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    im = i < HALF
    c = tl.load(cs_ptr + pos * stride_cs + i, mask=im, other=0.0)
    s = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=im, other=0.0)
    if INTERLEAVED:
        a_off = 2 * i
        b_off = 2 * i + 1
    else:
        a_off = i
        b_off = i + HALF

    # q_pe of every head, in place (before any early exit: padded rows still get a defined q)
    heads = tl.arange(0, BLOCK_H)
    hm = (heads < H)[:, None] & im[None, :]
    qrow = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + NOPE
    qa = tl.load(qrow + a_off[None, :], mask=hm, other=0.0).to(tl.float32)
    qb = tl.load(qrow + b_off[None, :], mask=hm, other=0.0).to(tl.float32)
    tl.store(qrow + a_off[None, :], (qa * c[None, :] - qb * s[None, :]).to(q_ptr.dtype.element_ty), mask=hm)
    tl.store(qrow + b_off[None, :], (qb * c[None, :] + qa * s[None, :]).to(q_ptr.dtype.element_ty), mask=hm)

    if slot >= 0:
        # kv_c: RMSNorm (fp32, rounded to the input dtype, then scaled by the weight)
        offs = tl.arange(0, BLOCK_L)
        lm = offs < L
        x = tl.load(kv_ptr + tok * stride_kvt + offs, mask=lm, other=0.0)
        xf = x.to(tl.float32)
        var = tl.sum(xf * xf, axis=0) / L
        y = (xf * tl.rsqrt(var + eps)).to(kv_ptr.dtype.element_ty)
        w = tl.load(w_ptr + offs, mask=lm, other=0.0)
        normed = (y.to(tl.float32) * w.to(tl.float32)).to(kv_ptr.dtype.element_ty)
        entry = cache_ptr + slot * (L + 2 * HALF)
        if FP8:
            normed = fp8_e4m3_value(normed.to(tl.float32), kv_scale, SCALED)
        tl.store(entry + offs, normed.to(cache_ptr.dtype.element_ty), mask=lm)
        # k_pe: RoPE, rounded to the input dtype, then into the cache entry after kv_c
        krow = kv_ptr + tok * stride_kvt + L
        ka = tl.load(krow + a_off, mask=im, other=0.0).to(tl.float32)
        kb = tl.load(krow + b_off, mask=im, other=0.0).to(tl.float32)
        ra = (ka * c - kb * s).to(kv_ptr.dtype.element_ty)
        rb = (kb * c + ka * s).to(kv_ptr.dtype.element_ty)
        if FP8:
            ra = fp8_e4m3_value(ra.to(tl.float32), kv_scale, SCALED)
            rb = fp8_e4m3_value(rb.to(tl.float32), kv_scale, SCALED)
        tl.store(entry + L + a_off, ra.to(cache_ptr.dtype.element_ty), mask=im)
        tl.store(entry + L + b_off, rb.to(cache_ptr.dtype.element_ty), mask=im)


@triton.jit
def _mla_prep_kernel(
    q_ptr, kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, wuk_ptr, qlat_ptr,
    T, H, stride_qt, stride_qh, stride_kvt, stride_cs, eps, stride_wh, stride_wn, stride_lt, stride_lh, kv_scale,
    L: tl.constexpr, BLOCK_L: tl.constexpr, NOPE: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr, FP8: tl.constexpr, SCALED: tl.constexpr,
    ABSORB: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_C: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    """Programs [0, T): one token's norm / RoPE / KV write. With ABSORB, programs from T on: the W_UK absorb
    of q_nope (it reads only q_nope, which the RoPE programs never touch, so the two roles are independent)."""
    pid = tl.program_id(0)
    if pid < T:
        _prep_token(q_ptr, kv_ptr, w_ptr, pos_ptr, cs_ptr, slot_ptr, cache_ptr, pid.to(tl.int64), H, stride_qt,
                    stride_qh, stride_kvt, stride_cs, eps, kv_scale, L, BLOCK_L, NOPE, HALF, BLOCK_HALF, BLOCK_H,
                    INTERLEAVED, FP8, SCALED)
    else:
        if ABSORB:
            _absorb_block(q_ptr, wuk_ptr, qlat_ptr, pid - T, T, H, stride_qt, stride_qh, stride_wh, stride_wn,
                          stride_lt, stride_lh, NOPE, BLOCK_K, BLOCK_T, BLOCK_C, NUM_C, UPCAST, PREC)


def mla_prep(
    q: torch.Tensor,  # [T, H, nope + R], its last R columns rotated in place
    kv_a: torch.Tensor,  # [T, L + R]: kv_c then k_pe (rows may be strided, e.g. a split of a merged GEMM)
    kv_norm_weight: torch.Tensor,  # [L]
    eps: float,
    positions: torch.Tensor,  # [T]
    cos_sin_cache: torch.Tensor,  # [max_pos, R] fp32: cos in [:R/2], sin in [R/2:]
    interleaved: bool,
    kv_cache: torch.Tensor,  # [num_blocks, page, L + R]
    slot_mapping: torch.Tensor,  # [T], -1 = write nothing
    w_uk: torch.Tensor | None = None,  # [H, nope, L]: also absorb q_nope through W_UK in the same launch
    kv_scale: float = 1.0,  # a float8_e4m3fn cache stores clamp(x / kv_scale, ±448)
    absorb_block_t: int = 16,  # tokens per absorb tile (the batch-invariant op fixes 64 for every batch)
) -> torch.Tensor | None:  # q_lat [T, H, L] in q's dtype when w_uk is given
    from deepinfer.errors import BackendError

    t, h, qw = q.shape
    r = cos_sin_cache.shape[-1]
    L = kv_a.shape[-1] - r
    if q.stride(-1) != 1 or kv_a.dim() != 2 or kv_a.stride(-1) != 1:
        raise BackendError(f"mla_prep: q {tuple(q.shape)} / kv_a {tuple(kv_a.shape)} need contiguous last dims")
    if r % 2 or qw < r or L <= 0 or kv_norm_weight.shape != (L,):
        raise BackendError(f"mla_prep: rope width {r}, q width {qw}, kv_a width {kv_a.shape[-1]} and norm weight "
                           f"{tuple(kv_norm_weight.shape)} do not fit together")
    if kv_cache.dim() != 3 or kv_cache.shape[-1] != L + r or not kv_cache.is_contiguous():
        raise BackendError(f"mla_prep: cache {tuple(kv_cache.shape)} entries are not {L} + {r} wide (contiguous)")
    if not (kv_a.shape[0] == positions.shape[0] == slot_mapping.shape[0] == t):
        raise BackendError(f"mla_prep: {t} q rows, {kv_a.shape[0]} kv rows, {positions.shape[0]} positions, "
                           f"{slot_mapping.shape[0]} slots")
    nope = qw - r
    q_lat = None
    grid = t
    absorb = dict(ABSORB=False, BLOCK_K=16, BLOCK_T=16, BLOCK_C=16, NUM_C=1, UPCAST=False, PREC=None)
    if w_uk is not None:
        if tuple(w_uk.shape) != (h, nope, L) or w_uk.stride(-1) != 1 or w_uk.dtype != q.dtype:
            raise BackendError(f"mla_prep: W_UK {tuple(w_uk.shape)} {w_uk.dtype} is not [{h}, {nope}, {L}] {q.dtype}")
        q_lat = torch.empty((t, h, L), dtype=q.dtype, device=q.device)
        block_c = min(128, triton.next_power_of_2(L))
        absorb = dict(ABSORB=True, BLOCK_K=max(16, triton.next_power_of_2(nope)), BLOCK_T=absorb_block_t,
                      BLOCK_C=block_c,
                      NUM_C=triton.cdiv(L, block_c), PREC="ieee" if q.dtype == torch.float32 else None,
                      UPCAST=envs.TRITON_INTERPRET.get() == "1")
        grid = t + triton.cdiv(t, absorb_block_t) * h * absorb["NUM_C"]
    if t == 0:
        return q_lat
    cs = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
    half = r // 2
    wk = w_uk if w_uk is not None else q
    ql = q_lat if q_lat is not None else q
    _mla_prep_kernel[(grid,)](
        q, kv_a, kv_norm_weight, positions, cs, slot_mapping, kv_cache, wk, ql,
        t, h, q.stride(0), q.stride(1), kv_a.stride(0), cs.stride(0), eps,
        wk.stride(0) if w_uk is not None else 0, wk.stride(1) if w_uk is not None else 0,
        ql.stride(0), ql.stride(1), float(kv_scale),
        L=L, BLOCK_L=triton.next_power_of_2(L), NOPE=nope, HALF=half, BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_H=triton.next_power_of_2(h), INTERLEAVED=interleaved, FP8=kv_cache.dtype == torch.float8_e4m3fn,
        SCALED=kv_scale != 1.0, **absorb, num_warps=4,
    )
    return q_lat
