"""Setters for plain checkpoint tensors (norm weights, router weights, embeddings) with shape checks."""

from __future__ import annotations

from dataclasses import dataclass
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


# ---------------------------------------------------------------- reading a rank's part (tensor / expert parallel)


@dataclass(frozen=True)
class ShardSlice:
    """The part of a stored tensor one rank reads: [start, stop) along dim."""

    dim: int
    start: int
    stop: int


class SlicedLoader:
    """A Loader that wants only `part` of the stored tensor: the checkpoint reader reads just that slice
    (safetensors' get_slice, so a rank never materializes the whole tensor) and calls `fn` with it."""

    def __init__(self, fn: Loader, part: ShardSlice):
        self.fn = fn
        self.part = part

    def __call__(self, t: torch.Tensor) -> None:
        self.fn(t)


class OtherRankTensor:
    """A Loader for a checkpoint tensor another rank holds (an expert placed elsewhere): expected in the
    checkpoint, never read here."""

    def __call__(self, t: torch.Tensor) -> None:  # pragma: no cover - the reader never calls it
        raise ModelLoadError("a tensor held by another rank was handed to this rank's loader")


OTHER_RANK = OtherRankTensor()


def sliced(fn: Loader, dim: int, start: int, stop: int) -> SlicedLoader:
    return SlicedLoader(fn, ShardSlice(dim, start, stop))


def then(load: Loader, after: Callable[[], None]) -> Loader:
    """`load`, then `after()` once it has stored its tensor; a SlicedLoader stays one (the reader still reads
    only its part) and OTHER_RANK stays OTHER_RANK (nothing is read, so nothing follows)."""
    if isinstance(load, OtherRankTensor):
        return load
    inner = load.fn if isinstance(load, SlicedLoader) else load

    def run(t: torch.Tensor) -> None:
        inner(t)
        after()

    return SlicedLoader(run, load.part) if isinstance(load, SlicedLoader) else run
