"""The nvidia backend's quantized linear methods: weights stay quantized in memory, the kernels dequantize.

- `TritonFp8W8A8Linear` ("fp8_w8a8"): e4m3 weight + fp32 128x128 scales kept as loaded (a dense weight
  is quantized online first); each call quantizes x per token per 128 channels (fp8_act_quant.py)
  and runs the block-scaled fp8 GEMM (fp8_gemm.py).
- `TritonInt4Linear` ("int4_awq" / "int4_gptq"): the checkpoint's packed int4 repacked once into the
  kernel's layout (int4_gemm.py), dequantized in the GEMM's inner loop.

`dense_weight` (for ops that fold a weight, e.g. MLA's absorbed kv_b_proj) dequantizes on demand.
"""

from __future__ import annotations

import torch

from deepinfer.backend import (
    Int4Weight,
    LinearMethod,
    dequant_fp8_block,
    int4_values,
    quantize_weight_fp8_block,
)
from deepinfer.errors import ModelLoadError

FP8 = torch.float8_e4m3fn


def _set(layer: torch.nn.Module, name: str, t: torch.Tensor | None) -> None:
    setattr(layer, name, None if t is None else torch.nn.Parameter(t.contiguous(), requires_grad=False))


def _flat(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


class TritonFp8W8A8Linear(LinearMethod):
    scheme = "fp8_w8a8"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = layer.weight.detach()
        s = getattr(layer, "weight_scale_inv", None)
        if w.dtype == FP8:
            if s is None:
                raise ModelLoadError("fp8 weight has no weight_scale_inv (128x128 block scales)")
            if tuple(s.shape) != (-(-w.shape[0] // 128), -(-w.shape[1] // 128)):
                raise ModelLoadError(f"fp8 weight_scale_inv has shape {tuple(s.shape)} for a {tuple(w.shape)} weight")
        elif s is not None:
            raise ModelLoadError(f"weight_scale_inv given for a {w.dtype} weight; expected float8_e4m3fn")
        else:
            w, s = quantize_weight_fp8_block(w)  # online quantization of a bf16 / fp16 / fp32 weight
        _set(layer, "weight", w)
        _set(layer, "weight_scale_inv", s.float())
        bias = getattr(layer, "bias", None)
        if bias is not None:
            _set(layer, "bias", bias.detach().to(compute_dtype))
        layer.compute_dtype = compute_dtype

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8
        from deepinfer.backends.nvidia.quant.fp8_gemm import fp8_block_gemm

        x2 = _flat(x)
        xq, xs = quantize_act_fp8(x2)
        y = fp8_block_gemm(xq, xs, layer.weight, layer.weight_scale_inv, x.dtype, getattr(layer, "bias", None))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return dequant_fp8_block(layer.weight, layer.weight_scale_inv).to(layer.compute_dtype)


class TritonInt4Linear(LinearMethod):
    """int4 weight-only for AWQ and GPTQ; `method` picks which packing process_weights expects."""

    def __init__(self, method: str):
        self.method = method
        self.scheme = f"int4_{method}"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = getattr(layer, "int4", None)
        if not isinstance(w, Int4Weight) or w.method != self.method:
            raise ModelLoadError(f"the {self.scheme} linear method needs the layer's packed {self.method} tensors "
                                 f"(layer.int4), got {getattr(w, 'method', type(w).__name__)}")
        q, z, s = int4_values(w)  # q [K, N] in 0..15, zeros with the offset applied, scales
        k, n = q.shape
        shifts = (torch.arange(8, device=q.device, dtype=torch.int32) * 4)
        packed = (q.view(k // 8, 8, n) << shifts[None, :, None]).sum(dim=1, dtype=torch.int64)
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)  # the words as int32 bits
        _set(layer, "qweight_kn", packed)
        _set(layer, "zeros_gn", z.to(torch.float16))
        _set(layer, "scales_gn", w.scales.to(torch.float16))
        _set(layer, "g_idx_k", w.groups_of_rows())
        layer.int4 = None
        layer.weight = None
        bias = getattr(layer, "bias", None)
        if bias is not None:
            _set(layer, "bias", bias.detach().to(compute_dtype))
        layer.compute_dtype = compute_dtype

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        from deepinfer.backends.nvidia.quant.int4_gemm import int4_gemm

        y = int4_gemm(_flat(x), layer.qweight_kn, layer.zeros_gn, layer.scales_gn, layer.g_idx_k,
                      getattr(layer, "bias", None))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """[out, in] from the kernel layout: the same (q - z) * s as the reference, in fp32, then rounded."""
        words = layer.qweight_kn
        shifts = torch.arange(8, device=words.device, dtype=torch.int32) * 4
        q = ((words[:, None, :] >> shifts[None, :, None]) & 0xF).reshape(-1, words.shape[1]).float()
        g = layer.g_idx_k.long()
        w = (q - layer.zeros_gn.float()[g]) * layer.scales_gn.float()[g]
        return w.t().contiguous().to(layer.compute_dtype)
