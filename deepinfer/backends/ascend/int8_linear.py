"""int8 W8A8 dynamic linears ("int8_w8a8", msModelSlim's W8A8_DYNAMIC) on `npu_dynamic_quant` + `npu_quant_matmul`.

Written to the documented signatures (torch_npu docs, Atlas A2 / A3; never run on hardware):
- `npu_dynamic_quant(x)` -> (int8 x, fp32 per-token scale): symmetric, scale = max|x_t| / 127;
- `npu_quant_matmul(x_q, w_q, scale, pertoken_scale=..., bias=..., output_dtype=...)`: int8 [m, k] x int8 [k, n]
  with int32 accumulation, scaled by scale[n] (the weight's per-channel scale, fp32) and pertoken_scale[m],
  bias added after the dequant, output fp16 / bf16.
The checkpoint's weight is int8 [out, in] with weight_scale [out, 1] and a zero weight_offset (symmetric);
the op takes the weight as [k, n], so it is transposed once at load (vllm-ascend does the same; the FRACTAL_NZ
cast it applies after is a speed choice left out here). The math equals the native oracle's
(native/quant_int8.py): both quantize x per token the same way, so only accumulation order differs.
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backend import LinearMethod
from deepinfer.errors import ModelLoadError

HALF = (torch.float16, torch.bfloat16)


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


def _per_channel(name: str, t: torch.Tensor | None, out_f: int) -> torch.Tensor | None:
    if t is None:
        return None
    if tuple(t.shape) not in ((out_f,), (out_f, 1)):
        raise ModelLoadError(f"int8_w8a8 on ascend: {name} has shape {tuple(t.shape)}, expected ({out_f}, 1)")
    return t.detach().reshape(out_f)


class NPUInt8W8A8Linear(LinearMethod):
    """int8 weights [k, n] + fp32 per-channel scales kept quantized in NPU memory; x quantized per call."""

    scheme = "int8_w8a8"

    def __init__(self, npu: ModuleType, device: torch.device) -> None:
        self.npu, self.device = npu, device

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        weight = getattr(layer, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.int8 or weight.dim() != 2:
            raise ModelLoadError("int8_w8a8 on ascend: the layer's weight must be int8 [out, in], got "
                                 f"{getattr(weight, 'dtype', type(weight).__name__)}")
        if compute_dtype not in HALF:
            raise ModelLoadError(f"int8_w8a8 on ascend: npu_quant_matmul outputs fp16 / bf16, not {compute_dtype}")
        out_f = weight.shape[0]
        scale = _per_channel("weight_scale", getattr(layer, "weight_scale", None), out_f)
        if scale is None:
            raise ModelLoadError("int8_w8a8 on ascend: the int8 weight has no weight_scale (one per output channel)")
        offset = _per_channel("weight_offset", getattr(layer, "weight_offset", None), out_f)
        if offset is not None and bool((offset != 0).any()):
            raise ModelLoadError("int8_w8a8 on ascend: weight_offset is nonzero: asymmetric int8 weights are not "
                                 "supported (W8A8_DYNAMIC weights are symmetric per channel)")
        layer.weight = _param(weight.detach().to(self.device).t())  # [k, n], what x2 is
        layer.weight_scale = _param(scale.to(device=self.device, dtype=torch.float32))
        layer.weight_offset = None
        bias = getattr(layer, "bias", None)
        if bias is not None:
            layer.bias = _param(bias.detach().to(device=self.device, dtype=compute_dtype))
        layer.compute_dtype = compute_dtype

    def _matmul(self, layer: torch.nn.Module, x2: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, pertoken = self.npu.npu_dynamic_quant(x2)
        return self.npu.npu_quant_matmul(xq, layer.weight, layer.weight_scale, pertoken_scale=pertoken,
                                         bias=bias, output_dtype=layer.compute_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1]).to(layer.compute_dtype)
        y = self._matmul(layer, x2, getattr(layer, "bias", None))
        return y.reshape(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """[out, in] in the compute dtype: the int8 weight times its per-channel scale (for folding / stacking)."""
        return (layer.weight.float() * layer.weight_scale.float()).t().to(layer.compute_dtype).contiguous()
