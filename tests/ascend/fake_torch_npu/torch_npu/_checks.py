"""Shared argument checks of the fake: what the documented operators refuse, the fake refuses."""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def dtype_in(name: str, t: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported (documented: {allowed})")


def dims(name: str, t: torch.Tensor, n: int) -> None:
    if t.dim() != n:
        raise ValueError(f"{name}: expected a {n}-D tensor, got shape {tuple(t.shape)}")


def unused(**kwargs) -> None:
    """Arguments the backend never passes: the fake does not emulate them."""
    for k, v in kwargs.items():
        if v is not None and v is not False:
            raise NotImplementedError(f"fake torch_npu: argument {k!r} is not emulated")
