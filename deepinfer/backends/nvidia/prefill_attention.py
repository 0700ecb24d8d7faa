"""Causal variable-length prefill attention (flash-attention style) in Triton.

MLA prefill runs as plain MHA over the up-projected context: q/k have
qk_nope + qk_rope (192 for DeepSeek) per head, v has v_head_dim (128).
Request i has q_len new tokens on top of ctx = k_len - q_len cached ones;
new token t (0-based) sees keys 0 .. ctx + t. Head dims that are not a power
of two are split into a power-of-two part and a masked remainder (192 =
128 + 64), so no FLOPs are wasted on padding for DeepSeek's shapes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import envs

_LOG2E = 1.4426950408889634


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_q_ptr, cu_k_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    scale_log2, D, DV,
    BLOCK_DA: tl.constexpr, BLOCK_DB: tl.constexpr, HAS_DB: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, PREC: tl.constexpr,
):
    mb = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q0 = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q0
    if mb * BLOCK_M >= q_len:
        return
    k0 = tl.load(cu_k_ptr + b)
    k_len = tl.load(cu_k_ptr + b + 1) - k0
    ctx = k_len - q_len

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    offs_a = tl.arange(0, BLOCK_DA)
    offs_b = BLOCK_DA + tl.arange(0, BLOCK_DB)
    offs_v = tl.arange(0, BLOCK_DV)
    vmask = offs_v < DV
    q_rows = q_ptr + (q0 + offs_m).to(tl.int64)[:, None] * stride_qt + h * stride_qh
    qa = tl.load(q_rows + offs_a[None, :], mask=mmask[:, None] & (offs_a[None, :] < D), other=0.0)
    if UPCAST:
        qa = qa.to(tl.float32)
    if HAS_DB:
        qb = tl.load(q_rows + offs_b[None, :], mask=mmask[:, None] & (offs_b[None, :] < D), other=0.0)
        if UPCAST:
            qb = qb.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    hi = tl.minimum(k_len, ctx + (mb + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < k_len
        k_rows = k_ptr + (k0 + offs_n).to(tl.int64)[:, None] * stride_kt + h * stride_kh
        ka = tl.load(k_rows + offs_a[None, :], mask=nmask[:, None] & (offs_a[None, :] < D), other=0.0)
        if UPCAST:
            ka = ka.to(tl.float32)
        qk = tl.dot(qa, tl.trans(ka), input_precision=PREC)
        if HAS_DB:
            kb = tl.load(k_rows + offs_b[None, :], mask=nmask[:, None] & (offs_b[None, :] < D), other=0.0)
            if UPCAST:
                kb = kb.to(tl.float32)
            qk += tl.dot(qb, tl.trans(kb), input_precision=PREC)
        allowed = nmask[None, :] & (offs_n[None, :] <= ctx + offs_m[:, None])
        qk = tl.where(allowed, qk * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + (k0 + offs_n).to(tl.int64)[:, None] * stride_vt + h * stride_vh + offs_v[None, :],
                    mask=nmask[:, None] & vmask[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = o_ptr + (q0 + offs_m).to(tl.int64)[:, None] * stride_ot + h * stride_oh
    tl.store(o_rows + offs_v[None, :], out.to(o_ptr.dtype.element_ty), mask=mmask[:, None] & vmask[None, :])


def _split_dim(d: int) -> tuple[int, int]:
    """d = a + b with a the largest power of two <= d; b padded to a power of two (0 if none)."""
    a = 1 << (d.bit_length() - 1)
    rest = d - a
    return a, (triton.next_power_of_2(rest) if rest else 0)


def prefill_attention(
    q: torch.Tensor,  # [Tq, H, D]
    k: torch.Tensor,  # [Tk, H, D]
    v: torch.Tensor,  # [Tk, H, DV]
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32
    cu_seqlens_k: torch.Tensor,  # [B + 1] int32
    max_q_len: int,
    softmax_scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:  # [Tq, H, DV]
    from deepinfer.errors import BackendError

    if q.shape[-1] != k.shape[-1] or k.shape[:2] != v.shape[:2] or q.shape[1] != k.shape[1]:
        raise BackendError(f"prefill_attention: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)}")
    if min(q.stride(-1), k.stride(-1), v.stride(-1)) != 1:
        raise BackendError("prefill_attention: q, k and v need a contiguous last dim")
    Tq, H, D = q.shape
    DV = v.shape[-1]
    B = cu_seqlens_q.shape[0] - 1
    out = torch.empty((Tq, H, DV), dtype=q.dtype, device=q.device)
    if Tq == 0 or B == 0:
        return out
    interpret = envs.TRITON_INTERPRET.get() == "1"
    da, db = _split_dim(D)
    if block_m is None:
        block_m = 16 if interpret else 64
    if block_n is None:
        block_n = 16 if interpret else 64
    grid = (triton.cdiv(max_q_len, block_m), B, H)
    _prefill_kernel[grid](
        q, k, v, out, cu_seqlens_q, cu_seqlens_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        softmax_scale * _LOG2E, D, DV,
        BLOCK_DA=da, BLOCK_DB=max(db, 16), HAS_DB=db > 0, BLOCK_DV=max(16, triton.next_power_of_2(DV)),
        BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=interpret and q.dtype == torch.bfloat16,
        PREC="ieee" if q.dtype == torch.float32 else None,
        num_warps=4 if interpret else 8, num_stages=1 if interpret else 2,
    )
    return out
