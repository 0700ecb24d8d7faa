"""Data-parallel replicas with expert parallelism: every replica runs every step's forward.

The MoE layers all-reduce over the ranks of every replica ("ep"), so a replica with nothing scheduled
must still take part: each step the replicas tell each other over "dp" whether they have work (one
integer all-reduced), and one with none runs a dummy forward of one token (worker/dummy_forward.py)
when any other has some. Without expert parallelism the replicas share no collective and none of this runs.
"""

from __future__ import annotations

import torch


class ReplicaForwardSync:
    def __init__(self, dp_comm, device: torch.device):
        self.comm = dp_comm
        self.device = device
        self.num_dummy_forwards = 0

    def any_replica_has_work(self, has_work: bool) -> bool:
        flag = torch.tensor([1 if has_work else 0], dtype=torch.int32, device=self.device)
        return int(self.comm.all_reduce(flag).item()) > 0
