"""Linear layers for the CPU: the native methods, with each weight kept transposed in memory.

The native method keeps W as loaded, [out, in] row-major, and F.linear asks the BLAS for x @ W^T
(an "NT" GEMM). On this repository's 2-core AVX2 test machine MKL's NN GEMM over W^T stored
[in, out] row-major streams a cache-cold weight markedly faster at decode shapes (the LM head
[8192, 256] at 1 row: 1.02 -> 0.51 ms; 16 rows: 2.86 -> 2.72 ms; an expert block [4352, 256] at
16 rows: 1.51 -> 1.11 ms; docs/perf-log/2026-12-01-cpu-vs-vllm-cpu.md). So after the native
`process_weights` (cast, fp8 dequantization), the weight is copied once into W^T and the layer's
`weight` becomes the [out, in] view `W^T.t()` of it: everything that reads `layer.weight` sees
the same values and shape, F.linear(x, weight) then runs the NN GEMM, and no second copy is kept.
"""

from __future__ import annotations

import torch

from deepinfer.backend import LinearMethod


class TransposedWeightLinear(LinearMethod):
    """Wraps a native LinearMethod: same math, weight stored [in, out] (see the module docstring)."""

    def __init__(self, inner: LinearMethod):
        self.inner = inner
        self.scheme = inner.scheme

    def process_weights(self, layer: torch.nn.Module, compute_dtype: torch.dtype) -> None:
        self.inner.process_weights(layer, compute_dtype)
        w = layer.weight
        if w.dim() == 2 and not (w.stride(0) == 1 and w.stride(1) == w.shape[0]):  # not already a transposed view
            layer.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=False)

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.inner.apply(layer, x)

    def dense_weight(self, layer: torch.nn.Module) -> torch.Tensor:
        return self.inner.dense_weight(layer)
