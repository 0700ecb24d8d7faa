"""Setters for plain checkpoint tensors (norm weights, router weights, embeddings) with shape checks."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.errors import ModelLoadError

Loader = Callable[[torch.Tensor], None]


def tensor_loader(
    owner: object, attr: str, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> Loader:
    """A setter that checks `name`'s shape, converts it to `dtype` on `device` and stores it as owner.attr."""

    def load(t: torch.Tensor) -> None:
        if tuple(t.shape) != tuple(shape):
            raise ModelLoadError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        if not t.is_floating_point() or t.dtype == torch.float8_e4m3fn:
            raise ModelLoadError(f"{name} has dtype {t.dtype}; expected a bf16/fp16/fp32 tensor")
        setattr(owner, attr, t.to(device=device, dtype=dtype))

    return load
