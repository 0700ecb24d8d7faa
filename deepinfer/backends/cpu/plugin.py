"""Registers the `cpu` backend through the same pluggy hook third-party backends use."""

from __future__ import annotations

from deepinfer.backend import BackendInfo, hookimpl


def _probe() -> list[str]:
    return []  # torch always runs on the CPU


@hookimpl
def deepinfer_register_backends(register) -> None:
    register(
        BackendInfo(
            name="cpu",
            backend_class="deepinfer.backends.cpu.backend:CPUBackend",
            probe=_probe,
            device_type="cpu",
            priority=0,
            description="torch-native reference ops on the CPU",
        )
    )
