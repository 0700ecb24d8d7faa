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
# the process groups a model may ask for (Backend.communicator(group); deepinfer/parallel/groups.py builds them)
PROCESS_GROUP_NAMES: tuple[str, ...] = ("tp", "dp", "ep")


class Communicator(ABC):
    """Collectives over one group of `world_size` ranks; this process is `rank` (its rank inside the group).

    Semantics (torch.distributed's, out of place: x is never modified; in a group of one the result may be
    x itself). Every rank of the group must make the same calls in the same order, with tensors of the same
    dtype, and of the same shape where the op says so:
    - all_reduce(x): the elementwise sum of x over the ranks, on every rank (same shape everywhere). Low
      precision (bf16 / fp16) is summed by the transport in that dtype, as NCCL and gloo do: a rounding per
      hop, the same bits on every rank;
    - all_gather(x, dim): the ranks' x (same shape everywhere) concatenated along dim in rank order;
    - reduce_scatter(x, dim): the sum over ranks of x (same shape everywhere), split along dim into
      world_size equal chunks; rank r gets chunk r;
    - all_to_all(x, input_splits, output_splits): x split along dim 0 by input_splits (equal chunks when
      None), chunk j sent to rank j; the chunks received concatenated in rank order. output_splits: the
      sizes received from each rank (so rank r's output_splits[j] is rank j's input_splits[r]); when None,
      equal chunks of x.shape[0] / world_size if input_splits is None too, else exchanged between the ranks
      first (one more small all_to_all). Chunks of size 0 are allowed; the trailing dims must match;
    - broadcast(x, src): rank src's x (src: the rank inside this group), on every rank (same shape).
    Bad arguments (a dim out of range, splits of the wrong length / sum / sign, a size that does not divide,
    a src outside the group) raise BackendError naming the argument, on the rank that passed them, before
    anything is sent. Arguments that are each valid but disagree between ranks are the caller's bug: the
    transport raises or the collective times out.
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


def check_dim(x: torch.Tensor, dim: int, op: str) -> int:
    """dim as a non-negative index into x, or BackendError naming `dim`."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise BackendError(f"{op}: dim={dim!r} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()


def check_splits(splits, world_size: int, name: str, op: str, total: int | None = None) -> list[int]:
    """`splits` as a list of world_size ints >= 0 (summing to `total` when given), or BackendError naming it."""
    try:
        out = [int(s) for s in splits]
        ok = all(not isinstance(s, bool) and int(s) == s for s in splits)
    except (TypeError, ValueError):
        out, ok = [], False
    if not ok or len(out) != world_size or any(s < 0 for s in out):
        raise BackendError(f"{op}: {name}={list(splits) if ok else splits!r} must be {world_size} integer "
                           f"sizes >= 0 (one per rank of the group)")
    if total is not None and sum(out) != total:
        raise BackendError(f"{op}: {name}={out} sum to {sum(out)}, but x has {total} rows along dim 0")
    return out


def equal_splits(rows: int, world_size: int, name: str, op: str) -> list[int]:
    """The equal chunks a None split list means, or BackendError naming the argument left None."""
    if rows % world_size:
        raise BackendError(f"{op}: {name}=None means equal chunks, but {rows} rows do not split into "
                           f"{world_size} equal chunks; pass {name}")
    return [rows // world_size] * world_size


def check_src(src, world_size: int) -> int:
    if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world_size:
        raise BackendError(f"broadcast: src={src!r} is not a rank of this group of {world_size} ranks "
                           f"(src is the rank inside the group, 0..{world_size - 1})")
    return src


def check_rows(x: torch.Tensor, op: str) -> int:
    if x.dim() == 0:
        raise BackendError(f"{op}: x must have at least one dimension (got a 0-d tensor)")
    return x.shape[0]


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
        check_dim(x, dim, "all_gather")
        return x

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        check_dim(x, dim, "reduce_scatter")
        return x

    def all_to_all(self, x: torch.Tensor, input_splits: list[int] | None = None,
                   output_splits: list[int] | None = None) -> torch.Tensor:
        rows = check_rows(x, "all_to_all")
        if input_splits is not None:
            check_splits(input_splits, 1, "input_splits", "all_to_all", total=rows)
        if output_splits is not None:
            check_splits(output_splits, 1, "output_splits", "all_to_all", total=rows)  # it receives its own rows
        return x

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        check_src(src, 1)
        return x


SINGLE_PROCESS = SingleProcessCommunicator()
