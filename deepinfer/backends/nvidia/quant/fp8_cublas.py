"""The W8A8 dense GEMM through cuBLAS's block-scaled fp8 kernels (torch's `scaled_mm` with DeepSeek's recipe:
1x128 activation scales, 128x128 weight scales), for prefill- and large-decode-sized M.

Why: on the H200 (2026-12-04, benchmarks/quant_gemm.py) the Triton fp8 GEMM (quant/fp8_gemm.py) ran at 0.40-0.74x of
bf16 cuBLAS at 256 rows and 0.52-0.85x at 16384, so fp8 linears slowed the steps they were meant to speed up. Its
K loop promotes the fp32 product every 128-wide block through the scales, which Triton schedules poorly; cuBLAS
has kernels built for exactly this scaling (`benchmarks/fp8_cublas_probe.py` measures them).

What cuBLAS reads (the layouts torch 2.11 checks, found by the probe): mat_a e4m3 [M, K] row-major; its scales
[M, K/128] fp32 column-major (strides (1, M): quantize_act_fp8(scales_col_major=True) writes them so); mat_b the
weight [N, K] read as its transpose [K, N] (a view); its scales [K/128, N/128] column-major, which is the weight's
row-major [N/128, K/128] scale tensor transposed (a view, no copy). The products are the reference's: each
128-wide K block's fp32 product times a_s * b_s, summed in fp32, rounded once to the output dtype.

Two more constraints, found on the H200: the weight scales' K/128 blocks must be a multiple of 4 (V2-Lite's shared
down, K 2816, has 22: `k4_scales` pads them with zeros, which scale nothing), and M must be aligned (M = 777 gave
CUBLAS_STATUS_NOT_SUPPORTED; the activations are quantized into M rounded up to ROW_ALIGN rows, zeros past M,
and the output is sliced back).

When (`use_cublas`): a GPU of compute capability 9.0 (Hopper: what the kernels exist for), a torch with
`torch.nn.functional.scaled_mm`, K a multiple of 128, more rows than the Triton GEMM's fused activation quant takes
(DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M), and DEEPINFER_FP8_CUBLAS not 0.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deepinfer import envs
from deepinfer.backend import ROW_ALIGN
from deepinfer.backends.nvidia.quant.fp8_act_quant import quantize_act_fp8


@functools.cache
def _available(device_index: int) -> bool:
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def use_cublas(x: torch.Tensor, weight: torch.Tensor, fused_act_quant: bool) -> bool:
    """Whether TritonFp8W8A8Linear.apply runs this call through cuBLAS (module docstring)."""
    if fused_act_quant or not envs.FP8_CUBLAS.get() or x.device.type != "cuda":
        return False
    if weight.shape[1] % 128:
        return False
    return _available(x.device.index if x.device.index is not None else torch.cuda.current_device())


def k4_scales(weight_scale: torch.Tensor) -> torch.Tensor:
    """The weight's [N/128, K/128] scales with K/128 padded (zeros) to a multiple of 4, row-major; the same tensor
    when it already is."""
    kb = weight_scale.shape[1]
    if kb % 4 == 0:
        return weight_scale
    out = torch.zeros(weight_scale.shape[0], -(-kb // 4) * 4, dtype=weight_scale.dtype, device=weight_scale.device)
    out[:, :kb] = weight_scale
    return out


def blockscaled_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale_k4: torch.Tensor, out_dtype: torch.dtype,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] in the compute dtype -> [M, N]: x quantized per token per 128 (rows padded to ROW_ALIGN, scales
    column-major), times the e4m3 weight [N, K] with its k4_scales, in out_dtype (+ bias)."""
    xq, xs = quantize_act_fp8(x, scales_col_major=True, pad_rows_to=ROW_ALIGN)
    return blockscaled_mm(xq, xs, x.shape[0], weight, weight_scale_k4, out_dtype, bias)


def blockscaled_mm(xq: torch.Tensor, xs_cm: torch.Tensor, rows: int, weight: torch.Tensor,
                   weight_scale_k4: torch.Tensor, out_dtype: torch.dtype,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """The first `rows` rows of xq [Mp, K] e4m3 (Mp a multiple of ROW_ALIGN) with column-major scales xs_cm [Mp,
    K/128], times the e4m3 weight [N, K] with its k4_scales: [rows, N] in out_dtype (+ bias). For activations that
    came quantized (backend/fp8_act.py) and for blockscaled_linear."""
    st = F.ScalingType
    y = F.scaled_mm(xq, weight.t(), xs_cm, st.BlockWise1x128, weight_scale_k4.t(), st.BlockWise128x128,
                    output_dtype=out_dtype)[:rows]
    return y if bias is None else y + bias
