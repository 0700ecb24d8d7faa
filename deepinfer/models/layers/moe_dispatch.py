"""Expert parallelism's token side: which rank computes each routed (token, slot) pair, and the data-parallel
gather that lets every rank see every replica's tokens (docs/parallelism.md).

Shared by every MoE layer that spreads whole experts over the "ep" ranks (V2/V3 `MoELayer`; V4's hash-routed
layers too: the mapping takes logical ids from any router, a tid2eid table included).
"""

from __future__ import annotations

import torch

from deepinfer.backend import Communicator
from deepinfer.models.layers.experts import ExpertPlacement


def gather_replicas(x: torch.Tensor, dp: Communicator) -> tuple[torch.Tensor, slice]:
    """(every data-parallel replica's tokens [sum T_d, D] in replica order, this replica's rows of them).

    One process per replica holds T_d tokens; the counts are all-gathered first (a host sync), then the
    hidden states padded to the largest T (at least one row, so a replica with no tokens still joins the
    collective with a well-formed tensor) and all-gathered; the padding rows are dropped."""
    if dp.world_size == 1:
        return x, slice(None)
    t = x.shape[0]
    counts = dp.all_gather(torch.tensor([t], dtype=torch.long, device=x.device)).tolist()
    width = max(1, max(counts))
    padded = x.new_zeros((width, x.shape[1]))
    padded[:t] = x
    gathered = dp.all_gather(padded.contiguous())  # [dp * width, D]
    if any(c != width for c in counts):
        rows = torch.cat([torch.arange(d * width, d * width + c, device=x.device) for d, c in enumerate(counts)])
        gathered = gathered.index_select(0, rows)
    start = sum(counts[: dp.rank])
    return gathered, slice(start, start + t)


class ExpertParallelRouting:
    """Logical ids -> this rank's local slot ids (or -1), as every rank computes them the same way.

    A pair (t, j) routed to logical expert e goes to e's replica number t mod replicas(e) (physical slots in
    slot order): a hot expert's tokens spread over its replicas, and the choice depends only on the row
    index, which every rank sees the same (the gathered batch)."""

    def __init__(self, placement: ExpertPlacement, rank: int, device):
        self.table, self.counts = placement.replica_table(device)
        self.base = rank * placement.slots_per_rank
        self.slots = placement.slots_per_rank
        self.replicated = self.table.shape[1] > 1

    def local_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T, k] logical (int64) -> [T, k] int64 in [0, slots_per_rank) or -1."""
        if self.replicated:
            rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
            phys = self.table[ids, rows % self.counts[ids]]
        else:
            phys = self.table[ids, 0]
        local = phys - self.base
        return torch.where((local >= 0) & (local < self.slots), local, torch.full_like(local, -1))

    @staticmethod
    def count(load: torch.Tensor, ids: torch.Tensor, local: torch.Tensor) -> None:
        """load [E] += pairs of each logical expert this rank computes (no host sync); summed over the "ep"
        ranks it is the number of (token, slot) pairs routed to each expert, each pair counted once."""
        load.scatter_add_(0, ids.reshape(-1), (local >= 0).reshape(-1).to(load.dtype))
