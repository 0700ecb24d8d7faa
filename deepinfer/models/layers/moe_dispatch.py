"""Expert parallelism's token side: which rank computes each routed (token, slot) pair, and the data-parallel
gather that lets every rank see every replica's tokens (docs/parallelism.md): the all-gather path. The
all-to-all path, which sends each pair to its slot's rank instead, is ep_all_to_all.py (it shares the
placement's replica table through `ExpertParallelRouting.physical`).

Shared by every MoE layer that spreads whole experts over the "ep" ranks (V2/V3 `MoELayer`; V4's hash-routed
layers too: the mapping takes logical ids from any router, a tid2eid table included).
"""

from __future__ import annotations

import dataclasses

import torch

from deepinfer.backend import Communicator
from deepinfer.errors import ConfigError
from deepinfer.models.layers.experts import ExpertPlacement


def gather_replicas(x: torch.Tensor, dp: Communicator, counts: list[int] | None = None) -> tuple[torch.Tensor, slice]:
    """(every data-parallel replica's tokens [sum T_d, D] in replica order, this replica's rows of them).

    One process per replica holds T_d tokens; the counts are all-gathered first (a host sync; `counts`: already
    gathered, ep_all_to_all.replica_counts), then the hidden states padded to the largest T (at least one row, so
    a replica with no tokens still joins the collective with a well-formed tensor) and all-gathered; the padding
    rows are dropped."""
    if dp.world_size == 1:
        return x, slice(None)
    t = x.shape[0]
    if counts is None:
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

    def physical(self, ids: torch.Tensor, salt: int) -> torch.Tensor:
        """ids [T, k] logical -> [T, k] global physical slots for the all-to-all path (ep_all_to_all.py), where
        each rank routes only its own rows: pair (t, j) of expert e takes e's replica (t + salt) mod replicas(e),
        salt = the sending rank, so the ranks' first rows do not all pick the same replica. Deterministic."""
        if not self.replicated:
            return self.table[ids, 0]
        rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1) + salt
        return self.table[ids, rows % self.counts[ids]]

    @staticmethod
    def count(load: torch.Tensor, ids: torch.Tensor, local: torch.Tensor) -> None:
        """load [E] += pairs of each logical expert this rank computes (no host sync); summed over the "ep"
        ranks it is the number of (token, slot) pairs routed to each expert, each pair counted once."""
        load.scatter_add_(0, ids.reshape(-1), (local >= 0).reshape(-1).to(load.dtype))


# ---------------------------------------------------------------- what both MoE layers (V2/V3, V4) share
# A layer here has: experts (ExpertWeights), op, spec (its MoESpec), backend, expert_parallel, placement, ep,
# and gets w13 / w2 / routing / quantized_experts set.


def make_moe_op(backend, spec, expert_parallel: bool):
    """The backend's MoE op for `spec`; under expert parallelism a ConfigError with the reasons when the op cannot
    compute a rank's share of the routed experts (-1 ids for other ranks' experts)."""
    op = backend.make_moe(spec)
    if expert_parallel:
        reasons = op.expert_parallel_reasons()
        if reasons:
            raise ConfigError("enable_expert_parallel: this backend's MoE op cannot compute a rank's share of "
                              "the routed experts: " + "; ".join(reasons))
    return op


def load_routed_experts(layer) -> None:
    """finalize's routed half: quantized experts stay quantized when the op runs their scheme (w13 / w2 then
    stay None: the load balancer cannot move them), else they are densified as every op takes them; under
    expert parallelism the stacked local weights are kept (EPLB moves them) and the id routing is built."""
    layer.quantized_experts = layer.experts.keeps_quantized(layer.op.quantized_expert_schemes())
    if layer.quantized_experts:
        layer.op.load_quantized_experts(layer.experts.quantized_stack())
        w13 = w2 = None
    else:
        w13, w2 = layer.experts.stacked()
        layer.op.load_experts(w13, w2)
    if layer.expert_parallel:
        layer.w13, layer.w2 = w13, w2
        layer.routing = ExpertParallelRouting(layer.placement, layer.ep.rank, layer.backend.device)


def install_placement(layer, placement: ExpertPlacement, w13: torch.Tensor, w2: torch.Tensor) -> None:
    """Between steps (the load balancer): a new placement and this rank's weights for its slots. The same slot
    count per rank swaps the op's weights in place; another count makes a new op for it."""
    if not layer.expert_parallel:
        raise ConfigError("install_placement: this MoE layer is not expert-parallel")
    if layer.quantized_experts:
        raise ConfigError("enable_eplb: this layer's routed experts are kept quantized, and moving quantized "
                          "experts between ranks is not built")
    if placement.slots_per_rank != layer.spec.local_experts:
        layer.spec = dataclasses.replace(layer.spec, num_local_experts=placement.slots_per_rank)
        layer.op = make_moe_op(layer.backend, layer.spec, True)
        layer.op.load_experts(w13, w2)
        layer.w13, layer.w2 = w13, w2
    else:
        layer.op.replace_experts(w13, w2)
        layer.w13.copy_(w13)
        layer.w2.copy_(w2)
    layer.placement = placement
    layer.routing = ExpertParallelRouting(placement, layer.ep.rank, layer.backend.device)
