"""Linear layers whose weights arrive from a checkpoint and run through the backend's linear method.

The scheme is chosen from what was loaded and the load's `LinearQuantSettings` (quant/settings.py):
an fp8 e4m3 weight with its `weight_scale_inv` runs as "fp8_block" (W8A16) or, when the settings ask
for fp8 activations, "fp8_w8a8"; an int4 record (`Int4Weight`, which the loader hands over under
`<prefix>.weight` for AWQ / GPTQ checkpoints) as "int4_awq" / "int4_gptq"; a dense weight as "none",
or "fp8_w8a8" (quantized at load) under online fp8; an msModelSlim int8 record (`Int8Weight`, int8 weight +
per-channel weight_scale / weight_offset, gathered by the loader the same way) as "int8_w8a8". The
backend's LinearMethod converts the loaded tensors (`process_weights`) and applies them; a backend whose
method runs the quantized format keeps it quantized in memory.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from deepinfer.backend import Backend, Int4Weight, LinearMethod
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.quant.settings import active_linear_quant
from deepinfer.models.loader import Int8Weight

FP8_DTYPE = torch.float8_e4m3fn
FP8_BLOCK = 128

Loader = Callable[[torch.Tensor], None]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def prepare_weight(
    name: str, t: torch.Tensor, shape: tuple[int, int], quantized: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Check a loaded `<name>.weight` and move it to the device: fp8 stays fp8, an int4 record stays packed,
    dense becomes the compute dtype."""
    if isinstance(t, Int4Weight):
        t.check(name, shape[0], shape[1])
        return Int4Weight(t.method, t.qweight.to(device), t.qzeros.to(device), t.scales.to(device),
                          None if t.g_idx is None else t.g_idx.to(device), t.group_size, t.zero_offset)
    if isinstance(t, Int8Weight):
        t.check(name, shape[0], shape[1])
        return t.to(device)
    if tuple(t.shape) != shape:
        raise ModelLoadError(f"{name}.weight has shape {tuple(t.shape)}, expected {shape}")
    if t.dtype == FP8_DTYPE:
        if not quantized:
            raise ModelLoadError(
                f"{name}.weight is float8_e4m3fn but config.json declares no fp8 quantization_config for this layer"
            )
        return t.to(device)
    if t.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return t.to(device=device, dtype=dtype)
    raise ModelLoadError(f"{name}.weight has unsupported dtype {t.dtype}")


def prepare_scale(name: str, t: torch.Tensor, out_features: int, in_features: int, device: torch.device) -> torch.Tensor:
    """Check a loaded `<name>.weight_scale_inv` (one fp32 scale per 128x128 block)."""
    expect = (_cdiv(out_features, FP8_BLOCK), _cdiv(in_features, FP8_BLOCK))
    if tuple(t.shape) != expect:
        raise ModelLoadError(f"{name}.weight_scale_inv has shape {tuple(t.shape)}, expected {expect}")
    return t.to(device=device, dtype=torch.float32)


class Linear(nn.Module):
    """y = x @ W^T (+ b), W [out, in] as loaded (compute dtype, or fp8 + block scales)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        backend: Backend,
        dtype: torch.dtype,
        bias: bool = False,
        quantized: bool = False,
    ):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.backend = backend
        self.dtype = dtype
        self.has_bias = bias
        self.quantized = quantized  # the checkpoint stores this layer as fp8 + weight_scale_inv
        self.weight: torch.Tensor | Int4Weight | Int8Weight | None = None
        self.int4: Int4Weight | None = None  # the packed record handed to an int4 method
        self.weight_scale_inv: torch.Tensor | None = None
        self.weight_scale: torch.Tensor | None = None  # int8_w8a8: per output channel [out, 1]
        self.weight_offset: torch.Tensor | None = None  # int8_w8a8: zero (symmetric), checked by the method
        self.bias: torch.Tensor | None = None
        self.method: LinearMethod | None = None
        self.name = ""

    # ------------------------------------------------------------ loading

    def loaders(self, prefix: str) -> dict[str, Loader]:
        """Checkpoint names this layer expects -> setter."""
        self.name = prefix
        out = {f"{prefix}.weight": self._set_weight}
        if self.quantized:
            out[f"{prefix}.weight_scale_inv"] = self._set_scale
        if self.has_bias:
            out[f"{prefix}.bias"] = self._set_bias
        return out

    def _set_weight(self, t: torch.Tensor) -> None:
        self.weight = prepare_weight(self.name, t, (self.out_features, self.in_features), self.quantized, self.dtype,
                                     self.backend.device)

    def _set_scale(self, t: torch.Tensor) -> None:
        self.weight_scale_inv = prepare_scale(self.name, t, self.out_features, self.in_features, self.backend.device)

    def _set_bias(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != (self.out_features,):
            raise ModelLoadError(f"{self.name}.bias has shape {tuple(t.shape)}, expected ({self.out_features},)")
        self.bias = t.to(device=self.backend.device, dtype=self.dtype)

    # ------------------------------------------------------------ after loading

    def scheme(self) -> str:
        if self.weight is None:
            raise ModelLoadError(f"{self.name}.weight was never loaded")
        if isinstance(self.weight, (Int4Weight, Int8Weight)):
            if self.weight_scale_inv is not None:
                raise ModelLoadError(f"{self.name}.weight_scale_inv is given for a {self.weight.scheme} weight")
            return self.weight.scheme
        settings = active_linear_quant()
        if self.weight.dtype == FP8_DTYPE:
            if self.weight_scale_inv is None:
                raise ModelLoadError(f"{self.name}.weight is fp8 but {self.name}.weight_scale_inv is missing")
            return settings.fp8_scheme()
        if self.weight_scale_inv is not None:
            raise ModelLoadError(f"{self.name}.weight_scale_inv is given but {self.name}.weight is not fp8 "
                                 f"(it is {self.weight.dtype})")
        return "fp8_w8a8" if settings.online == "fp8" else "none"

    def finalize(self) -> None:
        scheme = self.scheme()
        if isinstance(self.weight, Int4Weight):
            self.int4, self.weight = self.weight, None
        elif isinstance(self.weight, Int8Weight):  # the method reads weight / weight_scale / weight_offset
            rec = self.weight
            self.weight, self.weight_scale, self.weight_offset = rec.weight, rec.weight_scale, rec.weight_offset
        self.method = self.backend.linear_method(scheme)
        self.method.process_weights(self, self.dtype)

    def dense(self) -> torch.Tensor:
        """The weight as dense [out, in] in compute dtype, through the backend (for folding, stacking)."""
        if self.method is None:
            self.finalize()
        return self.method.dense_weight(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x)


class MergedLinear(nn.Module):
    """Several linears over the same input, run as one matmul when their weights can be concatenated.

    Output column groups are concatenated in `out_sizes` order. fp8 block scales
    concatenate only when every part but the last fills whole 128-row blocks;
    otherwise the parts run one by one and their outputs are concatenated.
    """

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        backend: Backend,
        dtype: torch.dtype,
        biases: list[bool] | None = None,
        quantized: bool = False,
    ):
        super().__init__()
        self.out_sizes = list(out_sizes)
        biases = biases or [False] * len(out_sizes)
        self.parts = nn.ModuleList(
            Linear(in_features, n, backend, dtype, bias=b, quantized=quantized) for n, b in zip(out_sizes, biases)
        )
        self.fused: Linear | None = None
        self.backend = backend
        self.dtype = dtype
        self.in_features = in_features

    def loaders(self, prefixes: list[str]) -> dict[str, Loader]:
        out: dict[str, Loader] = {}
        for part, prefix in zip(self.parts, prefixes):
            out.update(part.loaders(prefix))
        return out

    def _can_fuse(self, schemes: list[str]) -> bool:
        if len(set(schemes)) != 1 or schemes[0].startswith(("int4_", "int8_")):
            return False  # int4 / int8 parts run one by one (their quantized records are not concatenated)
        if schemes[0] in ("fp8_block", "fp8_w8a8") and any(p.weight.dtype == FP8_DTYPE for p in self.parts):
            return all(n % FP8_BLOCK == 0 for n in self.out_sizes[:-1])
        return True  # dense parts (online fp8 quantizes the fused matrix)

    def finalize(self) -> None:
        schemes = [p.scheme() for p in self.parts]
        if not self._can_fuse(schemes):
            for p in self.parts:
                p.finalize()
            return
        has_bias = any(p.bias is not None for p in self.parts)
        stored_fp8 = self.parts[0].weight.dtype == FP8_DTYPE
        fused = Linear(self.in_features, sum(self.out_sizes), self.backend, self.dtype, bias=has_bias,
                       quantized=stored_fp8)
        fused.name = "+".join(p.name for p in self.parts)
        fused.weight = torch.cat([p.weight for p in self.parts], dim=0)
        if stored_fp8:
            fused.weight_scale_inv = torch.cat([p.weight_scale_inv for p in self.parts], dim=0)
        if has_bias:
            fused.bias = torch.cat(
                [p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=self.dtype, device=p.weight.device)
                 for p in self.parts]
            )
        fused.finalize()
        self.fused = fused
        self.parts = nn.ModuleList()  # the loaded copies are no longer needed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([p(x) for p in self.parts], dim=-1)
