"""Linear layers: unquantized, and fp8 e4m3 with 128x128 block scales.

The native fp8 method dequantizes once at load (W = q * scale_inv per block)
and then runs a dense matmul in the compute dtype; it is the oracle that
fused fp8 GEMM kernels are compared with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.backend.layer_ops import LinearMethod
from deepinfer.errors import BackendError, ModelLoadError

FP8_BLOCK = 128
FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)
)


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 [out, in] = weight * scale_inv[i // block, j // block]; edge blocks may be partial."""
    out_f, in_f = weight.shape
    expect = (-(-out_f // block), -(-in_f // block))
    if tuple(scale_inv.shape) != expect:
        raise ModelLoadError(
            f"fp8 weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expect} for a "
            f"[{out_f}, {in_f}] weight with {block}x{block} blocks"
        )
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return weight.float() * scale


def _replace_weight(layer: torch.nn.Module, weight: torch.Tensor) -> None:
    layer.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)


def _cast_bias(layer: torch.nn.Module, dtype: torch.dtype) -> None:
    bias = getattr(layer, "bias", None)
    if bias is not None:
        layer.bias = torch.nn.Parameter(bias.detach().to(dtype), requires_grad=False)


def _drop_scale(layer: torch.nn.Module) -> None:
    """The scales are folded into the dense weight; keep no stale copy around."""
    try:
        delattr(layer, "weight_scale_inv")
    except AttributeError:
        pass
    if getattr(layer, "weight_scale_inv", None) is not None:  # a class attribute we cannot delete
        layer.weight_scale_inv = None


class UnquantizedLinear(LinearMethod):
    """Weights in the compute dtype (bf16 / fp16 / fp32)."""

    scheme = "none"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        weight = layer.weight
        if weight.dtype in FP8_DTYPES or getattr(layer, "weight_scale_inv", None) is not None:
            raise ModelLoadError(
                "an fp8 weight (with weight_scale_inv) was given to the unquantized linear method; "
                "load the checkpoint with quantization 'fp8_block'"
            )
        _replace_weight(layer, weight.detach().to(compute_dtype))
        _cast_bias(layer, compute_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, getattr(layer, "bias", None))

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return layer.weight


class Fp8BlockLinear(UnquantizedLinear):
    """e4m3 weights with `weight_scale_inv` [ceil(out/128), ceil(in/128)], dequantized at load.

    A layer whose weight is not fp8 and has no scale (a module the checkpoint
    left unquantized, e.g. via `modules_to_not_convert`) is kept as it is, cast
    to the compute dtype; an fp8 weight without scales is an error.
    """

    scheme = "fp8_block"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        weight = layer.weight
        scale_inv = getattr(layer, "weight_scale_inv", None)
        if weight.dtype in FP8_DTYPES:
            if scale_inv is None:
                raise ModelLoadError("fp8 weight has no weight_scale_inv (128x128 block scales)")
            dense = dequant_fp8_block(weight.detach(), scale_inv.detach())
        elif scale_inv is not None:
            raise ModelLoadError(f"weight_scale_inv given for a {weight.dtype} weight; expected float8_e4m3fn")
        else:
            dense = weight.detach()
        _replace_weight(layer, dense.to(compute_dtype))
        _cast_bias(layer, compute_dtype)
        _drop_scale(layer)


LINEAR_METHODS: dict[str, type[LinearMethod]] = {"none": UnquantizedLinear, "fp8_block": Fp8BlockLinear}


def native_linear_method(scheme: str) -> LinearMethod:
    try:
        return LINEAR_METHODS[scheme]()
    except KeyError:
        raise BackendError(
            f"unknown linear quant scheme {scheme!r} (native schemes: {', '.join(LINEAR_METHODS)})"
        ) from None
