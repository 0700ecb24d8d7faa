"""fp8 e4m3 block quantization in torch: the reference every fp8 kernel is compared with.

DeepSeek's recipe (DeepSeek-V3 report section 3.3, DeepGEMM): weights in 128x128 blocks and
activations per token per 128-channel group, each with one fp32 scale = amax / 448, values
e4m3(x / scale). A W8A8 GEMM multiplies the e4m3 operands and applies both scales per 128-wide
K block. The reference computes exactly that product in fp32 on the dequantized operands, so
a kernel and this file see the same quantized values and differ only in accumulation order.
"""

from __future__ import annotations

import torch

from deepinfer.errors import ModelLoadError

FP8_MAX = 448.0
FP8_GROUP = 128
# amax below this is clamped so an all-zero group gets a finite scale (and quantizes to zeros)
AMAX_FLOOR = 1e-10


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def quantize_act_fp8(x: torch.Tensor, group: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scales [T, ceil(K/group)]) with x ~= q * scale per token per group.

    The last group may be partial (K not a multiple of `group`): its amax is over the real columns."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act_fp8 takes [T, K], got shape {tuple(x.shape)}")
    t, k = x.shape
    g = _cdiv(k, group)
    xf = torch.zeros(t, g * group, dtype=torch.float32, device=x.device)
    xf[:, :k] = x.float()
    blocks = xf.view(t, g, group)
    scale = blocks.abs().amax(dim=2).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, g * group)[:, :k].contiguous(), scale.contiguous()


def dequant_act_fp8(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """fp32 [T, K] = q * scale[t, k // group]."""
    k = q.shape[1]
    return q.float() * scale.float().repeat_interleave(group, dim=1)[:, :k]


def quantize_weight_fp8_block(w: torch.Tensor, block: int = FP8_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (e4m3 [out, in], fp32 scale_inv [ceil(out/block), ceil(in/block)]): online quantization of
    a dense weight, the same rule as DeepSeek's fp8 release (scale = amax / 448 per block)."""
    out_f, in_f = w.shape
    ro, ri = _cdiv(out_f, block), _cdiv(in_f, block)
    padded = torch.zeros(ro * block, ri * block, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(ro, block, ri, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=AMAX_FLOOR) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(ro * block, ri * block)[:out_f, :in_f].contiguous(), scale.contiguous()


def check_fp8_scale(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_GROUP) -> None:
    expect = (_cdiv(weight.shape[0], block), _cdiv(weight.shape[1], block))
    if tuple(scale_inv.shape) != expect:
        raise ModelLoadError(
            f"fp8 weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expect} for a "
            f"[{weight.shape[0]}, {weight.shape[1]}] weight with {block}x{block} blocks"
        )


def w8a8_block_linear_ref(x: torch.Tensor, w_dense: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 reference: y = dequant(quant(x)) @ w_dense^T (+ bias), in fp32, returned in x's dtype.

    `w_dense` is the dequantized fp8 weight (q * scale_inv); x is quantized per token per 128 here."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, xs = quantize_act_fp8(x2)
    y = dequant_act_fp8(xq, xs) @ w_dense.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*shape[:-1], w_dense.shape[0])
