"""The collective ops of the contract: what a model calls where tensor, expert or data
parallelism needs devices to exchange tensors.

Models call these at the points parallel layouts need them (row-parallel outputs reduced,
vocab-parallel logits gathered, ...). A single-process run gets `SingleProcessCommunicator`,
whose ops are the identity (a group of one), so the calls cost a Python call and nothing on
the device. A backend with a multi-device runtime returns its own communicator from
`Backend.communicator()` (NCCL on NVIDIA, HCCL on Ascend, gloo on the CPU through
torch.distributed); the conformance suite checks every communicator against these semantics.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from deepinfer.errors import BackendError

COLLECTIVE_OPS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


class Communicator(ABC):
    """Collectives over one group of `world_size` ranks; this process is `rank`.

    Semantics (torch.distributed's, out of place):
    - all_reduce(x): the elementwise sum of x over the ranks, on every rank;
    - all_gather(x, dim): the ranks' x concatenated along dim in rank order;
    - reduce_scatter(x, dim): the sum over ranks of x, split along dim into world_size equal
      chunks; rank r gets chunk r;
    - all_to_all(x, input_splits, output_splits): x split along dim 0 by input_splits (equal
      chunks when None), chunk r sent to rank r; the chunks received concatenated in rank order
      (output_splits: the sizes received; equal when None);
    - broadcast(x, src): rank src's x, on every rank.
    """

    @property
    @abstractmethod
    def world_size(self) -> int: ...

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @abstractmethod
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor: ...

    @abstractmethod
    def all_to_all(self, x: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None) -> torch.Tensor: ...

    @abstractmethod
    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor: ...


class SingleProcessCommunicator(Communicator):
    """A group of one: every collective returns its input (checked, so a caller's split sizes or
    source rank that could not be right for one rank are errors, not silently accepted)."""

    @property
    def world_size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return x

    def all_to_all(self, x: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None) -> torch.Tensor:
        for name, splits in (("input_splits", input_splits), ("output_splits", output_splits)):
            if splits is not None and list(splits) != [x.shape[0]]:
                raise BackendError(f"all_to_all over one rank: {name}={list(splits)}, expected [{x.shape[0]}]")
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if src != 0:
            raise BackendError(f"broadcast from rank {src} in a group of one rank")
        return x
