"""The `cpu` backend: every op torch-native (deepinfer.core.native), the reference for the others."""

from __future__ import annotations

import os

import torch

from deepinfer.core.backend import Backend, BackendCaps
from deepinfer.core.native import NativeOps


def _meminfo_bytes() -> tuple[int, int]:
    """(available, total) host memory from /proc/meminfo; os.sysconf where that file is absent."""
    try:
        fields: dict[str, int] = {}
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts:
                    fields[key] = int(parts[0]) * 1024  # values are in kB
        total = fields["MemTotal"]
        free = fields.get("MemAvailable", fields.get("MemFree", 0))
        return free, total
    except (OSError, KeyError, ValueError):
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page


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
            quant_schemes=("none", "fp8_block"),
            model_types=("deepseek_v2", "deepseek_v3", "deepseek_v4"),
            batch_invariant=False,
            graph_capture=False,
            fp8=False,  # fp8 weights are dequantized at load, never computed in fp8
            fp4=False,
            max_tensor_parallel_size=1,
        )

    @property
    def caps(self) -> BackendCaps:
        return self._caps

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def memory_info(self) -> tuple[int, int]:
        return _meminfo_bytes()
