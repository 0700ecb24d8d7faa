"""Rotary embedding in Triton, interleaved (DeepSeek: pairs 2i, 2i+1) or by halves (NeoX).

cos / sin come from the fp32 cache [max_pos, R] (cos in [:R/2], sin in
[R/2:]) that already carries YaRN's frequencies and magnitude factor, so the
kernel is the same for plain and YaRN RoPE. One program per (token, head).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_row(src, dst, c, s, i, m, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    if INTERLEAVED:
        a_off = 2 * i
        b_off = 2 * i + 1
    else:
        a_off = i
        b_off = i + HALF
    a = tl.load(src + a_off, mask=m, other=0.0).to(tl.float32)
    b = tl.load(src + b_off, mask=m, other=0.0).to(tl.float32)
    tl.store(dst + a_off, (a * c - b * s).to(dst.dtype.element_ty), mask=m)
    tl.store(dst + b_off, (b * c + a * s).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _rope_kernel(
    pos_ptr, q_ptr, k_ptr, oq_ptr, ok_ptr, cs_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_oqt, stride_oqh, stride_okt, stride_okh, stride_cs,
    HQ, HK, HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    """One program per (token, head) over q's heads then k's heads: one launch for both."""
    pid = tl.program_id(0)
    heads = HQ + HK
    tok = (pid // heads).to(tl.int64)
    head = (pid % heads).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    c = tl.load(cs_ptr + pos * stride_cs + i, mask=m, other=0.0)
    s = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=m, other=0.0)
    if head < HQ:
        _rotate_row(q_ptr + tok * stride_qt + head * stride_qh, oq_ptr + tok * stride_oqt + head * stride_oqh,
                    c, s, i, m, HALF, INTERLEAVED)
    else:
        hk = head - HQ
        _rotate_row(k_ptr + tok * stride_kt + hk * stride_kh, ok_ptr + tok * stride_okt + hk * stride_okh,
                    c, s, i, m, HALF, INTERLEAVED)


def _check(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    from deepinfer.errors import BackendError

    if x.dim() != 3 or x.stride(-1) != 1:
        raise BackendError(f"rotary_embedding expects [T, H, R] with a contiguous last dim, got {tuple(x.shape)}")
    rot = x.shape[-1]
    if rot % 2 or cos_sin_cache.shape[-1] != rot:
        raise BackendError(f"rotary dim {rot} does not match the cos/sin cache width {cos_sin_cache.shape[-1]}")
    if positions.shape[0] != x.shape[0]:
        raise BackendError(f"rotary_embedding: {positions.shape[0]} positions for {x.shape[0]} tokens")


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """New rotated copies of q [T, Hq, R] and k [T, Hk, R], in one kernel launch."""
    _check(positions, q, cos_sin_cache)
    _check(positions, k, cos_sin_cache)
    oq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ok = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    n = q.shape[0] * (q.shape[1] + k.shape[1])
    if n:
        cs = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
        half = q.shape[-1] // 2
        _rope_kernel[(n,)](
            positions, q, k, oq, ok, cs, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            oq.stride(0), oq.stride(1), ok.stride(0), ok.stride(1), cs.stride(0), q.shape[1], k.shape[1],
            HALF=half, BLOCK=triton.next_power_of_2(half), INTERLEAVED=interleaved, num_warps=1,
        )
    return oq, ok
