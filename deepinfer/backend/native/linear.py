"""Linear methods in torch, one per quant scheme: the oracle every backend's kernels are compared with.

- "none": dense in the compute dtype.
- "fp8_block" (W8A16): e4m3 weights with 128x128 block scales, dequantized once at load (W = q *
  scale_inv per block), then a dense matmul on unquantized activations. What fp8 checkpoints run by
  default (and what the cpu backend runs for them).
- "fp8_w8a8" (W8A8, DeepSeek / DeepGEMM's recipe): the same weights, and the activations quantized per
  token per 128-channel group on the fly (quant_fp8.py); the reference dequantizes both and multiplies
  in fp32. A dense weight given to it is quantized at load (online fp8, 128x128 blocks).
- "int4_awq" / "int4_gptq" (weight-only, group 128): the checkpoint's packed tensors (quant_int4.py),
  dequantized once at load, then a dense matmul.
- "int8_w8a8" (msModelSlim's W8A8_DYNAMIC): int8 weights with a per-output-channel `weight_scale` (and a
  zero `weight_offset`), dequantized at load; the activations quantized per token to symmetric int8 at
  every call (quant_int8.py), both dequantized and multiplied in fp32, as the int8 kernel computes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.backend.layer_ops import LinearMethod
from deepinfer.backend.native.quant_fp8 import quantize_weight_fp8_block, w8a8_block_linear_ref
from deepinfer.backend.native.quant_int4 import Int4Weight, dequant_int4
from deepinfer.backend.native.quant_int8 import check_int8_weight, dequant_int8_per_channel, w8a8_int8_linear_ref
from deepinfer.errors import BackendError, ModelLoadError

FP8_BLOCK = 128
FP8_DTYPES = tuple(
    getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz") if hasattr(torch, n)
)


_FP8_TABLES: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def fp8_values(weight: torch.Tensor) -> torch.Tensor:
    """weight (a one-byte float dtype) as fp32, exactly (NaN codes give NaN). On the CPU through a 256-entry table of
    the format's values, indexed by the bytes: torch's element-wise fp8 -> fp32 conversion there is scalar, and on
    the embedded model's decode steps (2026-12-05, this 2-core CPU) it took 0.83 s of a 48-step cell's 1.99 s,
    dequantizing the routed experts each step (backend/native/moe.py); the table lookup is ~2.6x faster. Elsewhere
    the conversion itself."""
    if weight.device.type != "cpu":
        return weight.float()
    key = (weight.dtype, weight.device)
    table = _FP8_TABLES.get(key)
    if table is None:
        table = _FP8_TABLES[key] = torch.arange(256, dtype=torch.uint8).view(weight.dtype).float()
    return torch.take(table, weight.view(torch.uint8).long())


def dequant_fp8_block(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """fp32 [out, in] = weight * scale_inv[i // block, j // block]; edge blocks may be partial."""
    out_f, in_f = weight.shape
    expect = (-(-out_f // block), -(-in_f // block))
    if tuple(scale_inv.shape) != expect:
        raise ModelLoadError(
            f"fp8 weight_scale_inv has shape {tuple(scale_inv.shape)}, expected {expect} for a "
            f"[{out_f}, {in_f}] weight with {block}x{block} blocks"
        )
    values = fp8_values(weight)
    if out_f % block == 0 and in_f % block == 0:  # whole blocks: the scale broadcast over each (no expanded copy)
        scaled = values.view(expect[0], block, expect[1], block) * scale_inv.float()[:, None, :, None]
        return scaled.view(out_f, in_f)
    scale = scale_inv.float().repeat_interleave(block, 0)[:out_f].repeat_interleave(block, 1)[:, :in_f]
    return values * scale


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


class Fp8W8A8Linear(UnquantizedLinear):
    """W8A8 reference: the fp8 weight dequantized at load (a dense weight is first quantized online to
    128x128 e4m3 blocks), the activations quantized per token per 128 channels at every call."""

    scheme = "fp8_w8a8"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        weight = layer.weight.detach()
        scale_inv = getattr(layer, "weight_scale_inv", None)
        if weight.dtype in FP8_DTYPES:
            if scale_inv is None:
                raise ModelLoadError("fp8 weight has no weight_scale_inv (128x128 block scales)")
        elif scale_inv is not None:
            raise ModelLoadError(f"weight_scale_inv given for a {weight.dtype} weight; expected float8_e4m3fn")
        else:
            weight, scale_inv = quantize_weight_fp8_block(weight)  # online quantization
        _replace_weight(layer, dequant_fp8_block(weight, scale_inv.detach()).to(compute_dtype))
        _cast_bias(layer, compute_dtype)
        _drop_scale(layer)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return w8a8_block_linear_ref(x, layer.weight, getattr(layer, "bias", None))


def int4_weight(layer: torch.nn.Module, method: str) -> Int4Weight:
    """The layer's packed int4 record (`layer.int4`, an Int4Weight of `method`), checked."""
    w = getattr(layer, "int4", None)
    if not isinstance(w, Int4Weight):
        raise ModelLoadError(f"the int4_{method} linear method needs the layer's packed tensors (layer.int4), "
                             f"got {type(w).__name__}")
    if w.method != method:
        raise ModelLoadError(f"an int4 {w.method} weight was given to the int4_{method} linear method")
    return w


class Int4Linear(UnquantizedLinear):
    """int4 weight-only reference: the packed AWQ / GPTQ tensors dequantized once at load."""

    method = "awq"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        w = int4_weight(layer, self.method)
        _replace_weight(layer, dequant_int4(w).to(compute_dtype))
        layer.int4 = None  # the dense copy replaces the packed one
        _cast_bias(layer, compute_dtype)


class Int4AwqLinear(Int4Linear):
    scheme = "int4_awq"
    method = "awq"


class Int4GptqLinear(Int4Linear):
    scheme = "int4_gptq"
    method = "gptq"


class Int8W8A8Linear(UnquantizedLinear):
    """int8 W8A8 reference: `layer.weight` int8 [out, in] with `layer.weight_scale` [out, 1] (and an optional
    all-zero `layer.weight_offset`) dequantized at load; x quantized per token to int8 at every call.

    The dequantized weight is kept in fp32 (q * scale exactly, what the int8 kernel's int32 accumulation
    times the scales computes), not rounded to a bf16 / fp16 compute dtype: the oracle must not add a
    rounding the kernel does not make. dense_weight gives it in the compute dtype."""

    scheme = "int8_w8a8"

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        weight = layer.weight.detach()
        scale = check_int8_weight(weight, getattr(layer, "weight_scale", None), getattr(layer, "weight_offset", None))
        _replace_weight(layer, dequant_int8_per_channel(weight, scale))
        layer.weight_scale = layer.weight_offset = None  # folded into the dense copy
        layer.compute_dtype = compute_dtype
        _cast_bias(layer, compute_dtype)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return w8a8_int8_linear_ref(x, layer.weight, getattr(layer, "bias", None))

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return layer.weight.to(layer.compute_dtype)


LINEAR_METHODS: dict[str, type[LinearMethod]] = {
    "none": UnquantizedLinear,
    "fp8_block": Fp8BlockLinear,
    "fp8_w8a8": Fp8W8A8Linear,
    "int4_awq": Int4AwqLinear,
    "int4_gptq": Int4GptqLinear,
    "int8_w8a8": Int8W8A8Linear,
}


def native_linear_method(scheme: str) -> LinearMethod:
    try:
        return LINEAR_METHODS[scheme]()
    except KeyError:
        raise BackendError(
            f"unknown linear quant scheme {scheme!r} (native schemes: {', '.join(LINEAR_METHODS)})"
        ) from None
