"""ToyBackend: inherits every op from NativeOps, overrides three to count calls.

The counts let a test prove that generation really went through this backend;
TOY_BACKEND_BROKEN=1 makes rms_norm wrong by 1%, which `deepinfer check` must catch.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from deepinfer.backend import Backend, BackendCaps, MLAAttentionOp, MLASpec, NativeOps

CALLS: Counter = Counter()
BROKEN_ENV = "TOY_BACKEND_BROKEN"


class ToyBackend(NativeOps, Backend):
    name = "toy"

    def __init__(self) -> None:
        self._caps = BackendCaps(
            device_type="cpu",
            dtypes=(torch.float32,),
            kv_block_sizes=(16,),
            quant_schemes=("none", "fp8_block"),
            model_types=("deepseek_v2", "deepseek_v3"),
        )

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        CALLS["rms_norm"] += 1
        out = super().rms_norm(x, weight, eps)
        if os.environ.get(BROKEN_ENV):  # a kernel bug, for the conformance suite to catch
            out = out * 1.01
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        CALLS["add_rms_norm"] += 1
        return super().add_rms_norm(x, residual, weight, eps)

    def make_mla_attention(self, spec: MLASpec) -> MLAAttentionOp:
        CALLS["make_mla_attention"] += 1
        return super().make_mla_attention(spec)

    def memory_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 30  # a pretend 1 GiB device

    def op_coverage(self) -> dict[str, str]:
        return {**super().op_coverage(), "rms_norm": "toy", "add_rms_norm": "toy"}
