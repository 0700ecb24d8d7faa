"""SiLU-and-mul in Triton: silu(gate) * up in fp32, one read and one write per element."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, I, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + I + offs, mask=mask, other=0.0).to(tl.float32)
    # round silu(gate) to the activation dtype before the product, as torch's F.silu(gate) * up does
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = act * u
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    if x.shape[-1] % 2 or x.stride(-1) != 1:
        from deepinfer.errors import BackendError

        raise BackendError(f"silu_and_mul needs an even, contiguous last dim, got shape {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    inter = x2.shape[1] // 2
    out = torch.empty((x2.shape[0], inter), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
            x2, out, inter, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], inter)
