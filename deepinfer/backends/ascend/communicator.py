"""Collectives over torch.distributed's `hccl` backend (torch_npu registers it), with the contract's
semantics (backend/communicator.py). Written to torch.distributed's API; never run across NPUs.
The same class runs over any initialised process group, which is how the tests check it (gloo, CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.backend import Communicator
from deepinfer.errors import BackendError


class HCCLCommunicator(Communicator):
    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError("HCCLCommunicator needs torch.distributed initialised (init_process_group('hccl'))")
        self.group = group
        self._world = dist.get_world_size(group)
        self._rank = dist.get_rank(group)

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        parts = [torch.empty_like(x) for _ in range(self._world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        if x.shape[dim] % self._world:
            raise BackendError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split over "
                               f"{self._world} ranks")
        chunks = [c.contiguous() for c in x.chunk(self._world, dim=dim)]
        out = torch.empty_like(chunks[self._rank])
        dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def all_to_all(self, x: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None) -> torch.Tensor:
        if input_splits is not None and sum(input_splits) != x.shape[0]:
            raise BackendError(f"all_to_all: input_splits {input_splits} do not add up to {x.shape[0]} rows")
        rows = sum(output_splits) if output_splits is not None else x.shape[0]
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                               input_split_sizes=input_splits, group=self.group)
        return out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self._world:
            raise BackendError(f"broadcast from rank {src} in a group of {self._world} ranks")
        out = x.clone()
        dist.broadcast(out, src=src, group=self.group)
        return out
