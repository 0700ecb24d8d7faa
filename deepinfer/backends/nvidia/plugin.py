"""Registers the `nvidia` backend. The probe never creates a CUDA context.

It reads only files the driver publishes (/proc/driver/nvidia, /dev/nvidia*)
and what torch was built with; no CUDA runtime or NVML call is made, so a
process that probes and then forks stays CUDA-clean.
"""

from __future__ import annotations

import glob
import importlib.util
import os

from deepinfer.backend import BackendInfo, hookimpl


def _gpu_files_present() -> bool:
    if glob.glob("/proc/driver/nvidia/gpus/*"):
        return True
    return any(os.path.basename(p)[len("nvidia"):].isdigit() for p in glob.glob("/dev/nvidia[0-9]*"))


def probe() -> list[str]:
    """Reasons the nvidia backend cannot run here; [] when it can."""
    reasons: list[str] = []
    import torch  # torch import alone never touches the driver

    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} was built without CUDA")
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        reasons.append("CUDA_VISIBLE_DEVICES hides every GPU")
    elif not _gpu_files_present():
        reasons.append("no NVIDIA GPU found (no /proc/driver/nvidia/gpus/* or /dev/nvidiaN)")
    return reasons


def emulation() -> str | None:
    """The stand-in `--device nvidia` runs on where probe() finds no GPU: the same Triton kernels under
    Triton's interpreter on the CPU, when TRITON_INTERPRET=1 and triton is installed; else None."""
    from deepinfer.envs import TRITON_INTERPRET

    if TRITON_INTERPRET.get() != "1" or importlib.util.find_spec("triton") is None:
        return None
    return "Triton interpreter on the CPU (TRITON_INTERPRET=1)"


@hookimpl
def deepinfer_register_backends(register) -> None:
    register(
        BackendInfo(
            name="nvidia",
            backend_class="deepinfer.backends.nvidia.backend:NvidiaBackend",
            probe=probe,
            device_type="cuda",
            priority=10,
            description="Triton + CUDA C++ kernels for NVIDIA GPUs (SM90, SM100)",
            emulation=emulation,
        )
    )
