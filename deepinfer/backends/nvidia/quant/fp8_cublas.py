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

When (`use_cublas`): a GPU of compute capability 9.0 (Hopper: what the kernels exist for), a torch with
`torch.nn.functional.scaled_mm`, K a multiple of 512 (K/128 blocks a multiple of 4: torch rejects other weight
scale shapes, e.g. V2-Lite's shared down, K 2816), more rows than the Triton GEMM's fused activation quant takes
(DEEPINFER_FP8_FUSED_ACT_QUANT_MAX_M), and DEEPINFER_FP8_CUBLAS not 0.
"""

from __future__ import annotations

import functools

import torch

from deepinfer import envs


@functools.cache
def _available(device_index: int) -> bool:
    import torch.nn.functional as F

    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return False
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def use_cublas(x: torch.Tensor, weight: torch.Tensor, fused_act_quant: bool) -> bool:
    """Whether TritonFp8W8A8Linear.apply runs this call through cuBLAS (module docstring)."""
    if fused_act_quant or not envs.FP8_CUBLAS.get() or x.device.type != "cuda":
        return False
    if weight.shape[1] % 512:
        return False
    return _available(x.device.index if x.device.index is not None else torch.cuda.current_device())


def blockscaled_mm(xq: torch.Tensor, xs_col: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   out_dtype: torch.dtype, bias: torch.Tensor | None = None) -> torch.Tensor:
    """xq e4m3 [M, K], xs_col fp32 [M, K/128] with strides (1, M); weight e4m3 [N, K], weight_scale fp32
    [N/128, K/128] row-major -> [M, N] in out_dtype (+ bias)."""
    import torch.nn.functional as F

    st = F.ScalingType
    y = F.scaled_mm(xq, weight.t(), xs_col, st.BlockWise1x128, weight_scale.t(), st.BlockWise128x128,
                    output_dtype=out_dtype)
    return y if bias is None else y + bias
