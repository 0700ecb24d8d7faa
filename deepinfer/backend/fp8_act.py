"""Activations that reach fp8 W8A8 consumers already quantized, by the op that wrote them (issue 18: the act quant
"fused where it pays", into the preceding norm).

Why: under W8A8 a linear above its GEMM's own fused-quant size quantizes its input in a separate kernel (per token
per 128 channels), and a MoE layer's input was quantized twice (the shared experts' GEMM, the routed experts'). A
norm whose output feeds only such consumers writes the e4m3 values and scales in the same pass over each row
(`Backend.rms_norm_fp8`); every consumer then reads them as they are. The values are the reference's
(backend/native/quant_fp8.quantize_act_fp8 of the norm's output rounded to the compute dtype), so each product is the
one the separate kernel gave, bit for bit.

Layout (the union of what the W8A8 GEMMs read):
- x [T, K]: the producer's output in the compute dtype, for the consumers that read that (the MoE router; a
  linear whose GEMM quantizes on load), or None where no consumer does (the SiLU-and-mul before a W8A8 down);
- q [Tp, K] e4m3: rows padded with zeros to a multiple of ROW_ALIGN (cuBLAS's block-scaled GEMM wants aligned M);
- s [Tp, ceil(K/128)] fp32 row-major (the Triton GEMMs' scales) and s_cm the same values column-major (a view with
  strides (1, Tp): what cuBLAS reads). Both are written by the producer: 16 KB at 256 tokens, cheaper than a copy
  kernel or a second stride in every GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_GROUP = 128  # channels per activation scale (backend/native/quant_fp8.py)
ROW_ALIGN = 16  # rows of q / s are padded to a multiple of this (cuBLAS's block-scaled fp8 GEMM)


@dataclass(frozen=True)
class Fp8Act:
    x: torch.Tensor | None  # [T, K] compute dtype; None where the producer's consumers read only q / s
    q: torch.Tensor  # [Tp, K] float8_e4m3fn, Tp = T rounded up to ROW_ALIGN, zero rows past T
    s: torch.Tensor  # [Tp, G] fp32, row-major
    s_cm: torch.Tensor  # [Tp, G] fp32, column-major (strides (1, Tp)): the same values as s
    rows: int  # T

    def values(self) -> torch.Tensor:
        """x, for a consumer that reads the compute-dtype values; an error where the producer did not keep them."""
        if self.x is None:
            from deepinfer.errors import BackendError

            raise BackendError("Fp8Act: the compute-dtype values were not kept (x None): only a consumer whose "
                               "takes_fp8_act said yes may be given these activations")
        return self.x


def padded_rows(rows: int) -> int:
    return -(-rows // ROW_ALIGN) * ROW_ALIGN


def empty_fp8_act(rows: int, k: int, device, x: torch.Tensor | None = None) -> Fp8Act:
    """The buffers a producer fills for [rows, k] activations (q, s and the column-major s_cm's storage); x: the
    compute-dtype values' buffer, or None when they are not kept."""
    tp, g = padded_rows(rows), -(-k // FP8_GROUP)
    return Fp8Act(x=x, q=torch.empty((tp, k), dtype=torch.float8_e4m3fn, device=device),
                  s=torch.empty((tp, g), dtype=torch.float32, device=device),
                  s_cm=torch.empty((g, tp), dtype=torch.float32, device=device).t(), rows=rows)


def fp8_act_reference(x: torch.Tensor) -> Fp8Act:
    """x [T, K] quantized by the torch reference into Fp8Act's layout (the padding rows quantize zeros: q 0, the
    floor scale, as the kernels write them)."""
    if x.dim() != 2:
        raise ValueError(f"fp8_act_reference takes [T, K], got shape {tuple(x.shape)}")
    from deepinfer.backend.native.quant_fp8 import quantize_act_fp8  # native imports the contract: not at load

    out = empty_fp8_act(x.shape[0], x.shape[1], x.device, x)
    padded = torch.zeros((out.q.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
    padded[: x.shape[0]] = x
    q, s = quantize_act_fp8(padded)
    out.q.copy_(q)
    out.s.copy_(s)
    out.s_cm.copy_(s)
    return out


def rms_norm_fp8_reference(ops, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[Fp8Act, torch.Tensor | None]:
    """`rms_norm_fp8` from `ops`' own norm ops (ops: a Backend or NativeOps), then the torch reference quantization:
    the contract's default and the conformance oracle."""
    if residual is None:
        return fp8_act_reference(ops.rms_norm(x, weight, eps)), None
    out, total = ops.add_rms_norm(x, residual, weight, eps)
    return fp8_act_reference(out), total


def silu_and_mul_fp8_reference(ops, x: torch.Tensor, keep_values: bool = False) -> Fp8Act:
    """`silu_and_mul_fp8` from `ops`' silu_and_mul, then the torch reference quantization (the default, the
    oracle)."""
    act = fp8_act_reference(ops.silu_and_mul(x))
    return act if keep_values else replace(act, x=None)
