"""The routed experts' checkpoint tensors, from one tensor per expert to the stacked w13 / w2 the MoE op takes.

Checkpoints store one tensor per expert and projection (V2/V3:
`experts.E.{gate,up,down}_proj`, V4: `experts.E.{w1,w3,w2}`). They are held
as plain tensors while loading (V3 has 44k of them, too many to make modules
of), then densified through the backend's linear method (so fp8 experts are
dequantized by the backend, not here) and stacked. An int4 (AWQ / GPTQ) expert arrives as an
`Int4Weight` record and is densified the same way. The MoE op takes dense stacked weights: no
backend runs quantized routed experts yet (docs/quantization.md, "not done").
"""

from __future__ import annotations

import torch

from deepinfer.backend import Backend
from deepinfer.errors import ModelLoadError
from deepinfer.models.layers.linear import Linear, Loader, prepare_scale, prepare_weight


class ExpertWeights:
    """Loaders for `{prefix}.experts.E.{gate,up,down}` and their stacking into (w13 [E, 2I, D], w2 [E, D, I])."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, backend: Backend,
                 dtype: torch.dtype, quantized: bool, names: tuple[str, str, str]):
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.backend = backend
        self.dtype = dtype
        self.quantized = quantized
        self.names = names  # (gate, up, down) projection names
        self.prefix = ""
        self._loaded: dict[tuple[int, str, str], torch.Tensor] = {}  # (expert, proj, "weight"|"scale") -> tensor

    def _shape(self, proj: str) -> tuple[int, int]:
        """[out, in] of one projection: down is [D, I], gate and up are [I, D]."""
        if proj == self.names[2]:
            return self.hidden_size, self.intermediate_size
        return self.intermediate_size, self.hidden_size

    def _loader(self, e: int, proj: str, kind: str) -> Loader:
        name = f"{self.prefix}.experts.{e}.{proj}"
        out_f, in_f = self._shape(proj)
        dev = self.backend.device

        def load(t: torch.Tensor) -> None:
            if kind == "weight":
                self._loaded[(e, proj, kind)] = prepare_weight(name, t, (out_f, in_f), self.quantized, self.dtype, dev)
            else:
                self._loaded[(e, proj, kind)] = prepare_scale(name, t, out_f, in_f, dev)

        return load

    def loaders(self, prefix: str) -> dict[str, Loader]:
        """`prefix` is the MoE block's; the names are `{prefix}.experts.{e}.{proj}.weight` (+ `_scale_inv`)."""
        self.prefix = prefix
        out: dict[str, Loader] = {}
        for e in range(self.num_experts):
            for proj in self.names:
                out[f"{prefix}.experts.{e}.{proj}.weight"] = self._loader(e, proj, "weight")
                if self.quantized:
                    out[f"{prefix}.experts.{e}.{proj}.weight_scale_inv"] = self._loader(e, proj, "scale")
        return out

    def _dense(self, e: int, proj: str) -> torch.Tensor:
        """One expert matrix as dense compute-dtype [out, in], through the backend's linear method."""
        out_f, in_f = self._shape(proj)
        lin = Linear(in_f, out_f, self.backend, self.dtype, quantized=self.quantized)
        lin.name = f"{self.prefix}.experts.{e}.{proj}"
        if (e, proj, "weight") not in self._loaded:
            raise ModelLoadError(f"{lin.name}.weight was never loaded")
        lin.weight = self._loaded.pop((e, proj, "weight"))
        lin.weight_scale_inv = self._loaded.pop((e, proj, "scale"), None)
        return lin.dense()

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) in the compute dtype; the per-expert tensors are released."""
        E, D, inter = self.num_experts, self.hidden_size, self.intermediate_size
        gate, up, down = self.names
        dev = self.backend.device
        w13 = torch.empty((E, 2 * inter, D), dtype=self.dtype, device=dev)
        w2 = torch.empty((E, D, inter), dtype=self.dtype, device=dev)
        for e in range(E):
            w13[e, :inter] = self._dense(e, gate)
            w13[e, inter:] = self._dense(e, up)
            w2[e] = self._dense(e, down)
        return w13, w2
