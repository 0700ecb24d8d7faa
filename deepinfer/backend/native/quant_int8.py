"""int8 W8A8 dynamic (msModelSlim's "W8A8_DYNAMIC", as vllm-ascend loads it) in torch: the oracle.

Weights: int8 [out, in], symmetric per output channel, W = q * weight_scale[o] (`weight_scale` [out, 1]
in the checkpoint, `weight_offset` [out, 1] stored beside it and zero for this symmetric format).
Activations: quantized per token on the fly, symmetric int8: s_t = max|x_t| / 127, q_t = round(x_t / s_t)
clamped to [-127, 127]; what `npu_dynamic_quant` computes. The kernel then multiplies int8 x int8 with
int32 accumulation and scales each output by s_t * weight_scale[o]. The reference does the same in fp32
(dequantize both, matmul), so the conformance compares like with like: a difference left is accumulation
order, not quantization.
"""

from __future__ import annotations

import torch

from deepinfer.errors import ModelLoadError

INT8_MAX = 127.0


def quantize_act_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (int8 [..., K], fp32 scale [...]); a zero row gets scale 1 (its q is all zeros)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(xf / scale.unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def check_int8_weight(weight: torch.Tensor, scale: torch.Tensor | None, offset: torch.Tensor | None,
                      where: str = "int8_w8a8") -> torch.Tensor:
    """The per-channel fp32 scale [out] of an int8 [out, in] weight; refuses a wrong shape or a nonzero offset."""
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ModelLoadError(f"{where}: weight must be int8 [out, in], got {weight.dtype} {tuple(weight.shape)}")
    out_f = weight.shape[0]
    if scale is None:
        raise ModelLoadError(f"{where}: int8 weight has no weight_scale (one scale per output channel)")
    if tuple(scale.shape) not in ((out_f,), (out_f, 1)):
        raise ModelLoadError(f"{where}: weight_scale has shape {tuple(scale.shape)}, expected ({out_f}, 1) "
                             f"for a {tuple(weight.shape)} weight")
    if offset is not None:
        if tuple(offset.shape) not in ((out_f,), (out_f, 1)):
            raise ModelLoadError(f"{where}: weight_offset has shape {tuple(offset.shape)}, expected ({out_f}, 1)")
        if bool((offset != 0).any()):
            raise ModelLoadError(f"{where}: weight_offset is nonzero: asymmetric int8 weights are not supported "
                                 "(W8A8_DYNAMIC weights are symmetric per channel)")
    return scale.reshape(out_f).float()


def dequant_int8_per_channel(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 [out, in] = q * scale[o]."""
    return weight.float() * scale.reshape(-1, 1).float()


def w8a8_int8_linear_ref(x: torch.Tensor, weight_deq: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """y = dequant(quant_per_token(x)) @ W^T (+ b) in fp32, returned in x's dtype."""
    q, s = quantize_act_int8_per_token(x)
    y = (q.float() * s.unsqueeze(-1)) @ weight_deq.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
