"""The lazy torch_npu import and what the backend learns from it: versions, the chip, fake or real.

Operator signatures drift across torch_npu / CANN releases; `NpuRuntime.version` is what the
ops branch on (versions.py holds the table). Only this module imports torch_npu.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import ModuleType

import torch

from deepinfer.errors import BackendError


def parse_version(text: str) -> tuple[int, int, int]:
    """"2.7.1.post11" / "2.13.0+git..." -> (2, 7, 1)."""
    m = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not m:
        raise BackendError(f"cannot read the torch_npu version {text!r}")
    return int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)


def chip_family(soc_name: str) -> str:
    """"Ascend910B3" -> "a2"; "Ascend910_9392" -> "a3"; "Ascend950PR" -> "950"; "Ascend310P3" -> "310p"."""
    name = soc_name.lower().replace("ascend", "")
    if name.startswith("910b"):
        return "a2"
    if name.startswith("910_93"):
        return "a3"
    if name.startswith("950"):
        return "950"
    if name.startswith("310p"):
        return "310p"
    return "unknown"


@dataclass(frozen=True)
class NpuRuntime:
    module: ModuleType  # torch_npu
    version: tuple[int, int, int]
    soc_name: str
    chip: str
    fake: bool  # the test-only CPU fake: tensors stay on the CPU
    device: torch.device


def load_runtime(index: int | None = None) -> NpuRuntime:
    """Import torch_npu (which registers the "npu" device and torch.npu) and describe the device."""
    try:
        torch_npu = importlib.import_module("torch_npu")
    except ImportError as exc:
        raise BackendError(f"the ascend backend needs torch_npu: {exc}") from exc
    fake = bool(getattr(torch_npu, "__deepinfer_fake__", False))
    npu = torch_npu.npu
    if fake:
        device = torch.device("cpu")
    else:
        if not npu.is_available():
            raise BackendError("torch_npu sees no NPU (check the driver, CANN's set_env.sh, ASCEND_RT_VISIBLE_DEVICES)")
        device = torch.device("npu", index if index is not None else npu.current_device())
        npu.set_device(device)
    soc = npu.get_device_name(device.index if device.index is not None else 0)
    return NpuRuntime(torch_npu, parse_version(torch_npu.__version__), soc, chip_family(soc), fake, device)
