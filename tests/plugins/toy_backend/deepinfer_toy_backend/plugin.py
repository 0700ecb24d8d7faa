"""Registers the `toy` backend exactly as any third-party plugin would (pluggy hookimpl)."""

from __future__ import annotations

import os

from deepinfer.backend import BackendInfo, hookimpl

UNAVAILABLE_ENV = "TOY_BACKEND_UNAVAILABLE"


def probe() -> list[str]:
    """Cheap and device-free, like every probe; tests flip availability with an env var."""
    if os.environ.get(UNAVAILABLE_ENV):
        return [f"{UNAVAILABLE_ENV} is set (the toy device is switched off)"]
    return []


@hookimpl
def deepinfer_register_backends(register) -> None:
    register(
        BackendInfo(
            name="toy",
            backend_class="deepinfer_toy_backend.backend:ToyBackend",
            probe=probe,
            device_type="cpu",
            priority=-1,  # `auto` and `--device cpu` keep choosing the built-in cpu backend
            description="test-only third-party backend (torch-native ops, counted)",
        )
    )
