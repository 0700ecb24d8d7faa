"""`InvariantLinear`: any quant scheme's dense weight applied through the batch-invariant GEMM.

The nvidia backend runs every scheme on its dense weight (fp8 block weights are dequantized to the
compute dtype at load), so one wrapper covers them all: the inner method converts the weights, then
`apply` multiplies by its dense [out, in] weight (a transposed view, no copy) with gemm.linear.
"""

from __future__ import annotations

import torch

from deepinfer.backend import LinearMethod
from deepinfer.backends.nvidia.invariant.counters import tile_counters
from deepinfer.backends.nvidia.invariant.gemm import linear
from deepinfer.backends.nvidia.invariant.tile_choice import check_gemm


class InvariantLinear(LinearMethod):
    def __init__(self, inner: LinearMethod):
        self.inner = inner
        self.scheme = inner.scheme

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        self.inner.process_weights(layer, compute_dtype)
        w = self.inner.dense_weight(layer)
        tile_counters(w.device, 0)  # at load, never first inside a graph capture
        check_gemm(w.t().unsqueeze(0))  # its large tile for prefill, where this device keeps the bits (tile_choice)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.inner.dense_weight(layer))
        bias = getattr(layer, "bias", None)
        return y if bias is None else y + bias  # an elementwise add: row-invariant

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return self.inner.dense_weight(layer)
