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
def _rope_kernel(
    pos_ptr, x_ptr, out_ptr, cs_ptr, stride_xt, stride_xh, stride_ot, stride_oh, stride_cs,
    H, HALF: tl.constexpr, BLOCK: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    pid = tl.program_id(0)
    tok = (pid // H).to(tl.int64)
    head = (pid % H).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    c = tl.load(cs_ptr + pos * stride_cs + i, mask=m, other=0.0)
    s = tl.load(cs_ptr + pos * stride_cs + HALF + i, mask=m, other=0.0)
    base = x_ptr + tok * stride_xt + head * stride_xh
    obase = out_ptr + tok * stride_ot + head * stride_oh
    if INTERLEAVED:
        a_off = 2 * i
        b_off = 2 * i + 1
    else:
        a_off = i
        b_off = i + HALF
    a = tl.load(base + a_off, mask=m, other=0.0).to(tl.float32)
    b = tl.load(base + b_off, mask=m, other=0.0).to(tl.float32)
    tl.store(obase + a_off, (a * c - b * s).to(out_ptr.dtype.element_ty), mask=m)
    tl.store(obase + b_off, (b * c + a * s).to(out_ptr.dtype.element_ty), mask=m)


def _apply(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    from deepinfer.errors import BackendError

    if x.dim() != 3 or x.stride(-1) != 1:
        raise BackendError(f"rotary_embedding expects [T, H, R] with a contiguous last dim, got {tuple(x.shape)}")
    rot = x.shape[-1]
    if rot % 2 or cos_sin_cache.shape[-1] != rot:
        raise BackendError(f"rotary dim {rot} does not match the cos/sin cache width {cos_sin_cache.shape[-1]}")
    if positions.shape[0] != x.shape[0]:
        raise BackendError(f"rotary_embedding: {positions.shape[0]} positions for {x.shape[0]} tokens")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[0] * x.shape[1]
    if n:
        cs = cos_sin_cache if cos_sin_cache.dtype == torch.float32 else cos_sin_cache.float()
        half = rot // 2
        _rope_kernel[(n,)](
            positions, x, out, cs, x.stride(0), x.stride(1), out.stride(0), out.stride(1), cs.stride(0),
            x.shape[1], HALF=half, BLOCK=triton.next_power_of_2(half), INTERLEAVED=interleaved, num_warps=1,
        )
    return out


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return _apply(positions, q, cos_sin_cache, interleaved), _apply(positions, k, cos_sin_cache, interleaved)
