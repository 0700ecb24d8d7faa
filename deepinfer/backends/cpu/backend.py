"""The `cpu` backend: every op torch-native (deepinfer.backend.native), the reference for the others."""

from __future__ import annotations

import torch

from deepinfer.backend import Backend, BackendCaps, NativeOps, host_memory_info


class CPUBackend(NativeOps, Backend):
    """Torch on the host CPU.

    batch_invariant is False: the CPU GEMM library may pick a different
    blocking (and so a different summation order) for different row counts,
    so a row's result can depend on its batch; we have not proven otherwise.
    """

    name = "cpu"

    def __init__(self) -> None:
        self._caps = BackendCaps(
            device_type="cpu",
            dtypes=(torch.float32, torch.bfloat16, torch.float16),
            kv_block_sizes=(16,),
            quant_schemes=("none", "fp8_block"),  # fp8 weights are dequantized at load, computed in the dtype
            model_types=("deepseek_v2", "deepseek_v3", "deepseek_v4"),
            batch_invariant=False,
            graph_capture=False,
            max_tensor_parallel_size=1,
        )

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        return host_memory_info()
