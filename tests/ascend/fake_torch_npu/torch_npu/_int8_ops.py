"""npu_dynamic_quant and npu_quant_matmul (int8 W8A8 with a per-token activation scale).

Documented semantics (torch_npu docs, Atlas A2 / A3):
- npu_dynamic_quant(input, *, smooth_scales=None, group_index=None, dst_type=torch.int8) -> (y, scale):
  per row of the last dim, scale = max|x| / 127 (fp32, shape input.shape[:-1]) and y = round(x / scale)
  as int8. input fp16 / bf16. smooth_scales / group_index are not used by the backend (not emulated).
- npu_quant_matmul(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, ...):
  x1 int8 [m, k], x2 int8 [k, n]; int32 accumulation; out = acc * scale[n] * pertoken_scale[m] (+ bias),
  in output_dtype (fp16 / bf16 when pertoken_scale is given). scale fp32 [n] or [1] (bf16 also allowed for a
  bf16 output), pertoken_scale fp32 [m], bias [n] (int32 / fp32 / the output dtype). Emulated exactly:
  the integer product in int64 (no overflow at these k), the dequant in fp32, rounded once.
"""

from __future__ import annotations

import torch

from torch_npu._checks import HALF, dims, dtype_in, unused


def npu_dynamic_quant(input: torch.Tensor, *, smooth_scales=None, group_index=None,
                      dst_type: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    unused(smooth_scales=smooth_scales, group_index=group_index)
    dtype_in("input", input, HALF)
    if dst_type != torch.int8:
        raise NotImplementedError(f"fake torch_npu: npu_dynamic_quant dst_type {dst_type} is not emulated (int8 only)")
    x = input.float()
    amax = x.abs().amax(dim=-1)
    scale = amax / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = torch.round(x / safe.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return y, scale


def npu_quant_matmul(x1: torch.Tensor, x2: torch.Tensor, scale: torch.Tensor, *, offset=None,
                     pertoken_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                     output_dtype: torch.dtype | None = None, x1_dtype=None, x2_dtype=None,
                     pertoken_scale_dtype=None, scale_dtype=None, group_sizes=None) -> torch.Tensor:
    unused(offset=offset, x1_dtype=x1_dtype, x2_dtype=x2_dtype, pertoken_scale_dtype=pertoken_scale_dtype,
           scale_dtype=scale_dtype, group_sizes=group_sizes)
    dtype_in("x1", x1, (torch.int8,))
    dtype_in("x2", x2, (torch.int8,))
    dims("x1", x1, 2)
    dims("x2", x2, 2)
    m, k = x1.shape
    if x2.shape[0] != k:
        raise ValueError(f"npu_quant_matmul: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)}: k differs")
    n = x2.shape[1]
    if pertoken_scale is None:
        raise NotImplementedError("fake torch_npu: npu_quant_matmul without pertoken_scale is not emulated")
    if output_dtype not in HALF:
        raise ValueError(f"npu_quant_matmul: output_dtype {output_dtype} with pertoken_scale (documented: fp16 / bf16)")
    dtype_in("pertoken_scale", pertoken_scale, (torch.float32,))
    if tuple(pertoken_scale.shape) != (m,):
        raise ValueError(f"npu_quant_matmul: pertoken_scale shape {tuple(pertoken_scale.shape)}, expected ({m},)")
    dtype_in("scale", scale, (torch.float32, torch.bfloat16) if output_dtype == torch.bfloat16 else (torch.float32,))
    if tuple(scale.shape) not in ((n,), (1,)):
        raise ValueError(f"npu_quant_matmul: scale shape {tuple(scale.shape)}, expected ({n},) or (1,)")
    acc = (x1.to(torch.int64) @ x2.to(torch.int64)).float()
    out = acc * scale.float() * pertoken_scale.unsqueeze(-1)
    if bias is not None:
        dtype_in("bias", bias, (torch.int32, torch.float32, output_dtype))
        if tuple(bias.shape) != (n,):
            raise ValueError(f"npu_quant_matmul: bias shape {tuple(bias.shape)}, expected ({n},)")
        out = out + bias.float()
    return out.to(output_dtype)
