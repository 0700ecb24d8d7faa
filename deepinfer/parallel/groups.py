"""The process groups of a layout and the communicators the backend hands the model.

torch.distributed requires every rank to create every subgroup, in the same order, even the groups it
is not in; `build_communicators` does that for the "tp", "dp" and "ep" groups of `ParallelLayout` and
returns this rank's three communicators (a group of one is the identity communicator). The default
process group must already be initialized (deepinfer/parallel/launch.py).

The "cp" group (context-parallel prefill) is made by `build_cp_communicator`, after those three on every
rank. Its communicator is not installed in the backend (the contract's `Backend.communicator` knows "tp",
"dp" and "ep"): the context-parallel forward holds it and hands it to the layers inside the step's batch
(parallel/context_parallel.py), so no layer does context-parallel work outside a split step.
"""

from __future__ import annotations

import torch.distributed as dist

from deepinfer.backend import Communicator, SingleProcessCommunicator
from deepinfer.parallel.layout import ParallelLayout


def _group_of(groups_ranks: list[list[int]], rank: int, name: str, timeout=None):
    mine = None
    for ranks in groups_ranks:
        g = dist.new_group(ranks, timeout=timeout) if len(ranks) > 1 else None  # every rank creates every group
        if rank in ranks:
            mine = (g, ranks)
    if mine is None:  # pragma: no cover - a layout always places every rank
        raise RuntimeError(f"rank {rank} is in no {name} group")
    return mine


def build_communicators(layout: ParallelLayout, rank: int, backend, timeout=None) -> dict[str, Communicator]:
    """{"tp", "dp", "ep"} -> this rank's communicator, made by `backend.make_communicator`.

    timeout (a timedelta): how long a collective of these groups waits for a rank (EngineConfig.dist_timeout_s);
    None = the default group's."""
    out: dict[str, Communicator] = {}
    plan = {"tp": layout.all_tp_groups(), "dp": layout.all_dp_groups(),
            "ep": [list(range(layout.world_size))] if layout.enable_expert_parallel else [[r] for r in
                                                                                          range(layout.world_size)]}
    for name, groups_ranks in plan.items():
        group, ranks = _group_of(groups_ranks, rank, name, timeout)
        out[name] = SingleProcessCommunicator() if group is None else backend.make_communicator(group, name)
    return out


def build_cp_communicator(layout: ParallelLayout, rank: int, backend, timeout=None) -> Communicator:
    """This rank's "cp" communicator (the identity when context_parallel_size is 1); every rank calls it, after
    build_communicators, since every rank must create every group."""
    group, _ = _group_of(layout.all_cp_groups(), rank, "cp", timeout)
    return SingleProcessCommunicator() if group is None else backend.make_communicator(group, "cp")
