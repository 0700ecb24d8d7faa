"""int4 weight-only linears ("int4_awq" / "int4_gptq") on torch_npu's `npu_weight_quant_batchmatmul` (W4A16).

The documented op (torch_npu docs, Atlas A2 / A3) computes y = x @ ((w + antiquant_offset) * antiquant_scale)
with w a signed int4 weight [K, N] carried in int32 words (`npu_convert_weight_to_int4pack` packs an int32
[K, N] of values in [-8, 7] into [K, N/8]) and per-group scale / offset [K/group, N] in x's dtype. The
checkpoints store unsigned q in 0..15 with a zero point z: W = (q - z) * s. So w = q - 8 and
offset = 8 - z give (w + offset) * s = (q - z) * s exactly (offsets are small integers, exact in fp16 / bf16).
The scales are rounded to the compute dtype (the op takes them in x's dtype), a difference from the fp32
dequantizing reference within the low-precision tolerances.

A per-group antiquant needs the rows of group g to be rows 128g..128g+127: GPTQ act-order checkpoints
(g_idx not equal to arange(K) // 128) cannot be mapped and are refused at load, naming the layer's g_idx.
The packing order of `npu_convert_weight_to_int4pack` is the op's own business: nothing here unpacks its
words (dense_weight runs the op on an identity matrix).
"""

from __future__ import annotations

from types import ModuleType

import torch

from deepinfer.backend import Int4Weight, LinearMethod, int4_values
from deepinfer.errors import ModelLoadError, UnsupportedOpError

GROUP = 128  # the contract's int4 group; antiquant_group_size


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous(), requires_grad=False)


class NPUInt4Linear(LinearMethod):
    """int4 AWQ / GPTQ (`method`) as npu_weight_quant_batchmatmul's int32-packed W4A16 weight."""

    def __init__(self, npu: ModuleType, method: str, device: torch.device) -> None:
        self.npu, self.method, self.device = npu, method, device
        self.scheme = f"int4_{method}"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = getattr(layer, "int4", None)
        if not isinstance(w, Int4Weight) or w.method != self.method:
            raise ModelLoadError(f"the {self.scheme} linear method needs the layer's packed {self.method} tensors "
                                 f"(layer.int4), got {getattr(w, 'method', type(w).__name__)}")
        if compute_dtype not in (torch.float16, torch.bfloat16):
            raise ModelLoadError(f"{self.scheme} on ascend: npu_weight_quant_batchmatmul takes fp16 / bf16 "
                                 f"activations, not {compute_dtype}")
        if w.group_size != GROUP:
            raise ModelLoadError(f"{self.scheme} on ascend: group_size {w.group_size} (only {GROUP} is mapped)")
        k = (w.qweight.shape[0] if self.method == "awq" else w.qweight.shape[0] * 8)
        if w.g_idx is not None:
            want = torch.arange(k, device=w.g_idx.device) // GROUP
            if not torch.equal(w.g_idx.long(), want):
                raise UnsupportedOpError(f"{self.scheme} on ascend: g_idx is not arange(in_features) // {GROUP} "
                                     "(an act-order GPTQ checkpoint); npu_weight_quant_batchmatmul's per-group "
                                     "antiquant needs contiguous groups, so this checkpoint is refused")
        q, z, s = int4_values(w)  # q int32 [K, N] in 0..15, zeros (offset applied) fp32 [G, N], scales fp32
        signed = (q - 8).to(self.device)
        layer.qweight_npu = _param(self.npu.npu_convert_weight_to_int4pack(signed.contiguous()))
        layer.antiquant_offset = _param((8.0 - z).to(device=self.device, dtype=compute_dtype))
        layer.antiquant_scale = _param(s.to(device=self.device, dtype=compute_dtype))
        layer.in_features = k
        layer.int4 = None
        layer.weight = None
        bias = getattr(layer, "bias", None)
        if bias is not None:
            layer.bias = _param(bias.detach().to(device=self.device, dtype=compute_dtype))
        layer.compute_dtype = compute_dtype

    def _matmul(self, layer: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor:
        return self.npu.npu_weight_quant_batchmatmul(x2, layer.qweight_npu, layer.antiquant_scale,
                                                     antiquant_offset=layer.antiquant_offset,
                                                     antiquant_group_size=GROUP)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        # the op's bias takes fp16 / fp32 only (its docs): added here in the compute dtype instead
        y = self._matmul(layer, x.reshape(-1, x.shape[-1]).to(layer.compute_dtype))
        bias = getattr(layer, "bias", None)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        """[out, in]: the op applied to an identity, i.e. (w + offset) * scale as the op dequantizes it."""
        eye = torch.eye(layer.in_features, device=self.device, dtype=layer.compute_dtype)
        return self._matmul(layer, eye).t().contiguous()
