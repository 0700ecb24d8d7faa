"""The communicator over a torch.distributed process group: gloo on the CPU, NCCL on NVIDIA, HCCL on Ascend.

One class serves every backend whose runtime speaks torch.distributed: the job picks the process group's
transport at init (deepinfer/parallel/launch.py), deepinfer/parallel/groups.py makes the subgroups, and this
class calls the collectives with the semantics of `Communicator` (backend/communicator.py), out of place,
on tensors wherever they live (CPU for gloo, the device for NCCL / HCCL).

Choices, checked on torch 2.13's gloo (tests/parallel/test_communicators.py, `deepinfer check --world-size N`):
- all_to_all goes through `all_to_all_single` with split sizes: uneven splits and chunks of size 0 work on
  gloo, NCCL and HCCL alike (gloo's list `all_to_all` refuses chunks of different sizes).
- reduce_scatter: on gloo it is one all_reduce, then this rank's chunk (gloo's own reduce_scatter runs one
  all_reduce per rank: world_size times the traffic); on other transports `dist.reduce_scatter`.
- bf16 / fp16: gloo, NCCL and HCCL sum them natively; no upcast is made (so the bits are those the transport
  gives, the same on every rank). Dtypes a transport has no kernels for (gloo: the float8 types) are refused
  by it with its own error; the data-movement ops (all_gather, all_to_all, broadcast) move those as raw
  bytes instead, which is exact.
- a group of one returns x itself (after the same argument checks), like SingleProcessCommunicator.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from deepinfer.backend.communicator import (
    Communicator,
    check_dim,
    check_rows,
    check_splits,
    check_src,
    equal_splits,
)
from deepinfer.errors import BackendError

# dtypes gloo has no kernels for; moved as bytes by the ops that only move data
_BYTE_MOVED = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                 "float8_e8m0fnu") if hasattr(torch, n))
REDUCE_SCATTER_MODES = ("auto", "native", "all_reduce")


class TorchDistributedCommunicator(Communicator):
    """Collectives over `group` (a torch.distributed ProcessGroup this process belongs to; None: the world).

    expect_transport: when given ("nccl", "hccl", "gloo"), the group must run on it (a backend's tensors on
    its device through a group of another transport fail deep inside torch otherwise).
    reduce_scatter: "auto" (gloo: all_reduce + chunk, else native), "native" or "all_reduce".
    """

    def __init__(self, group=None, name: str = "", *, expect_transport: str | None = None,
                 reduce_scatter: str = "auto"):
        if not dist.is_available() or not dist.is_initialized():
            raise BackendError(f"communicator {name or 'world'!r}: torch.distributed is not initialized "
                               "(init_process_group comes first: deepinfer/parallel/launch.py)")
        if reduce_scatter not in REDUCE_SCATTER_MODES:
            raise BackendError(f"reduce_scatter={reduce_scatter!r}: choose one of {REDUCE_SCATTER_MODES}")
        self.group = group if group is not None else dist.group.WORLD
        self.name = name
        self.transport = str(dist.get_backend(self.group)).lower()
        if expect_transport is not None and self.transport != expect_transport.lower():
            raise BackendError(f"communicator {name or 'world'!r}: its process group runs on {self.transport!r}, "
                               f"this backend needs {expect_transport!r} (init_process_group({expect_transport!r}))")
        self._world = dist.get_world_size(self.group)
        self._rank = dist.get_rank(self.group)
        if self._rank < 0:
            raise BackendError(f"communicator {name or 'world'!r}: this process is not in its group")
        self.ranks: list[int] = dist.get_process_group_ranks(self.group)  # group rank -> global rank
        self._rs_via_all_reduce = reduce_scatter == "all_reduce" or (reduce_scatter == "auto"
                                                                       and self.transport == "gloo")

    def __repr__(self) -> str:
        return (f"TorchDistributedCommunicator({self.name or 'world'!r}, {self.transport}, rank {self._rank} of "
                f"{self._world}, global ranks {self.ranks})")

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def rank(self) -> int:
        return self._rank

    # ------------------------------------------------------------ reductions

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            return x
        out = x.clone(memory_format=torch.contiguous_format)
        if out.numel():
            dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = check_dim(x, dim, "reduce_scatter")
        if x.shape[dim] % self._world:
            raise BackendError(f"reduce_scatter: dim={dim} has size {x.shape[dim]}, which does not split into "
                               f"{self._world} equal chunks (one per rank)")
        if self._world == 1:
            return x
        if self._rs_via_all_reduce:
            return self.all_reduce(x).chunk(self._world, dim=dim)[self._rank].contiguous()
        chunks = [c.contiguous() for c in x.chunk(self._world, dim=dim)]
        out = torch.empty_like(chunks[self._rank])
        if out.numel():
            dist.reduce_scatter(out, chunks, op=dist.ReduceOp.SUM, group=self.group)
        return out

    # ------------------------------------------------------------ data movement

    def all_gather(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        dim = check_dim(x, dim, "all_gather")
        if self._world == 1:
            return x
        send = _as_moved(x.contiguous())
        # one buffer, the ranks' x stacked along dim 0 (what every transport's all_gather_into_tensor fills)
        flat = send.new_empty((self._world * send.shape[0], *send.shape[1:]))
        if send.numel():
            dist.all_gather_into_tensor(flat, send, group=self.group)
        flat = _from_moved(flat, x.dtype)
        if dim == 0:
            return flat
        return torch.cat(flat.view(self._world, *x.shape).unbind(0), dim=dim)

    def all_to_all(self, x: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None) -> torch.Tensor:
        n = self._world
        rows = check_rows(x, "all_to_all")
        if input_splits is None:
            ins = equal_splits(rows, n, "input_splits", "all_to_all")
        else:
            ins = check_splits(input_splits, n, "input_splits", "all_to_all", total=rows)
        if output_splits is not None:
            outs = check_splits(output_splits, n, "output_splits", "all_to_all")
        elif input_splits is None:
            outs = list(ins)
        else:
            outs = self._exchange_splits(ins, x.device)
        if n == 1:
            if outs != ins:
                raise BackendError(f"all_to_all over one rank: output_splits={outs} must equal input_splits={ins}")
            return x
        send = _as_moved(x.contiguous())
        recv = send.new_empty((sum(outs), *send.shape[1:]))
        dist.all_to_all_single(recv, send, output_split_sizes=outs, input_split_sizes=ins, group=self.group)
        return _from_moved(recv, x.dtype)

    def _exchange_splits(self, ins: list[int], device: torch.device) -> list[int]:
        """What every rank sends this one: rank j's ins[self.rank], by one all_to_all of n ints."""
        sizes = torch.tensor(ins, dtype=torch.int64, device=device)
        recv = torch.empty_like(sizes)
        dist.all_to_all_single(recv, sizes, group=self.group)
        return [int(v) for v in recv.tolist()]

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        check_src(src, self._world)
        if self._world == 1:
            return x
        out = _as_moved(x.clone(memory_format=torch.contiguous_format))
        if out.numel():
            dist.broadcast(out, src=self.ranks[src], group=self.group)  # torch takes the global rank
        return _from_moved(out, x.dtype)


def _as_moved(x: torch.Tensor) -> torch.Tensor:
    """x, or its bytes (float8: one uint8 per element) when the transport has no kernels for its dtype."""
    return x.view(torch.uint8) if x.dtype in _BYTE_MOVED and x.dim() else x


def _from_moved(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.view(dtype) if x.dtype != dtype else x
