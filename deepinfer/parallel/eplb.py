"""EPLB, the expert load balancer: count each expert's load online, place redundant replicas of the hot
experts and repack the physical experts over the expert-parallel ranks, between steps.

The algorithm is the "global" policy of DeepSeek's published EPLB (github.com/deepseek-ai/EPLB; the DeepSeek-V3
report, "redundant experts"), written here from its description:
1. replication: start with one replica per logical expert, then give each redundant slot, one at a time, to
   the expert with the largest load per replica (ties: the lowest id);
2. balanced packing: the physical replicas (each carrying load / replicas of its expert), heaviest first
   (ties: expert id, then replica number), each onto the rank with the least load so far among the ranks with
   a free slot (ties: the lowest rank). Every rank gets the same number of slots.
The hierarchical variant (groups onto nodes first) is not built: one placement over all ranks.

Within a rank, an expert the rank already held keeps its slot where it can, so fewer weights move; and a new
placement whose heaviest rank is not lighter than the current one's is not installed (nothing moves).

Counting: each expert-parallel MoE layer adds, per forward, the (token, slot) pairs it computes to a
per-logical-expert counter on the device (models/layers/moe_dispatch.py); `ExpertBalancer.loads()` all-reduces
them over "ep" so every rank sees the same loads and computes the same placement. Moving: each rank sends the
experts it holds to the ranks that newly host them in one all_to_all per layer (uneven splits; the source of an
expert is the lowest rank that held it), then the layer swaps its placement and the op's weights.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.backend import Backend
from deepinfer.errors import ConfigError
from deepinfer.models.layers.experts import ExpertPlacement


def replicate_experts(load: Sequence[float], num_slots: int) -> list[int]:
    """Replicas per logical expert (each >= 1, summing to num_slots): each extra slot to the expert with the
    largest load per replica."""
    n = len(load)
    if num_slots < n:
        raise ConfigError(f"EPLB: {num_slots} physical slots cannot hold {n} logical experts")
    counts = [1] * n
    for _ in range(num_slots - n):
        best = max(range(n), key=lambda e: (load[e] / counts[e], -e))
        counts[best] += 1
    return counts


def balanced_packing(weights: Sequence[float], num_packs: int) -> list[int]:
    """The pack of each item: heaviest first onto the lightest pack that has room (len / num_packs items each)."""
    if len(weights) % num_packs:
        raise ConfigError(f"EPLB: {len(weights)} items do not pack evenly into {num_packs} ranks")
    cap = len(weights) // num_packs
    order = sorted(range(len(weights)), key=lambda i: (-weights[i], i))
    pack_load, pack_items, where = [0.0] * num_packs, [0] * num_packs, [0] * len(weights)
    for i in order:
        p = min((q for q in range(num_packs) if pack_items[q] < cap), key=lambda q: (pack_load[q], q))
        where[i] = p
        pack_load[p] += weights[i]
        pack_items[p] += 1
    return where


def rank_loads(placement: ExpertPlacement, load: Sequence[float]) -> list[float]:
    """Each rank's share of the load when every expert's pairs spread evenly over its replicas."""
    counts = placement.replica_counts()
    out = [0.0] * placement.ep_size
    for s, e in enumerate(placement.slot_experts):
        out[s // placement.slots_per_rank] += load[e] / counts[e]
    return out


def compute_placement(load: Sequence[float], ep_size: int, num_slots: int,
                      previous: ExpertPlacement | None = None) -> ExpertPlacement:
    """The balanced placement for one layer's per-expert loads (deterministic: the same loads give the same
    placement on every rank). `previous`: keep its experts in their slots where they stay on a rank."""
    n = len(load)
    if num_slots % ep_size:
        raise ConfigError(f"EPLB: {num_slots} physical slots (n_routed_experts + eplb_num_redundant_experts) do not "
                          f"split evenly over {ep_size} expert-parallel ranks")
    counts = replicate_experts(load, num_slots)
    items = [(e, c) for e in range(n) for c in range(counts[e])]
    packs = balanced_packing([load[e] / counts[e] for e, _ in items], ep_size)
    per = num_slots // ep_size
    chosen: list[list[int]] = [[] for _ in range(ep_size)]
    for (e, _), p in zip(items, packs):
        chosen[p].append(e)
    slots: list[int] = []
    for r in range(ep_size):
        want = sorted(chosen[r])
        row: list[int | None] = [None] * per
        if previous is not None and previous.slots_per_rank == per:
            for j, e in enumerate(previous.rank_experts(r)):  # an expert staying on r keeps its slot
                if e in want:
                    row[j] = e
                    want.remove(e)
        free = [j for j in range(per) if row[j] is None]
        for j, e in zip(free, want):
            row[j] = e
        slots.extend(row)  # type: ignore[arg-type]
    return ExpertPlacement(n, ep_size, tuple(slots))


@dataclass(frozen=True)
class Transfer:
    """Expert `expert` goes from rank src's local slot src_slot to rank dst's local slot dst_slot."""

    expert: int
    src: int
    src_slot: int
    dst: int
    dst_slot: int


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> tuple[list[Transfer], list[tuple[int, int, int]]]:
    """(transfers between ranks in (dst, dst_slot) order, local copies (rank, old slot, new slot)): every new slot
    takes its expert from this rank's old slots when it held it, else from the lowest rank that did."""
    transfers, local = [], []
    for d in range(new.ep_size):
        held = old.rank_experts(d)
        for j, e in enumerate(new.rank_experts(d)):
            if e in held:
                local.append((d, held.index(e), j))
                continue
            src = next(r for r in range(old.ep_size) if e in old.rank_experts(r))
            transfers.append(Transfer(e, src, old.rank_experts(src).index(e), d, j))
    return transfers, local


def _expert_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if getattr(m, "expert_parallel", False) and hasattr(m, "install_placement")]


class ExpertBalancer:
    """The engine's handle on EPLB for one model (every rank builds one, after the model is loaded).

    - construction turns on the load counters of every expert-parallel MoE layer and, with num_redundant > 0,
      installs the first placement with that many redundant slots (from uniform loads: replicas of the lowest
      ids until loads are counted), moving weights as a rebalance does;
    - `rebalance()`: between steps, on every rank at the same step (it runs collectives over "ep"): the counted
      loads -> new placements -> weights moved -> counters reset. Returns how many experts moved between ranks;
    - `step()`: call once per engine step; rebalances every `step_interval` steps (EngineConfig.eplb_step_interval).
    """

    def __init__(self, model: nn.Module, backend: Backend, num_redundant: int = 0, step_interval: int = 1000):
        if isinstance(num_redundant, bool) or not isinstance(num_redundant, int) or num_redundant < 0:
            raise ConfigError(f"EngineConfig.eplb_num_redundant_experts must be an integer >= 0 (got {num_redundant!r})")
        if isinstance(step_interval, bool) or not isinstance(step_interval, int) or step_interval < 1:
            raise ConfigError(f"EngineConfig.eplb_step_interval must be an integer >= 1 (got {step_interval!r})")
        self.comm = backend.communicator("ep")
        self.layers = _expert_layers(model)
        if not self.layers:
            raise ConfigError("enable_eplb: the model has no expert-parallel MoE layer (needs enable_expert_parallel "
                              "and a world size > 1)")
        quantized = [i for i, layer in enumerate(self.layers) if getattr(layer, "quantized_experts", False)]
        if quantized:
            raise ConfigError(f"enable_eplb: {len(quantized)} MoE layers keep their routed experts quantized "
                              "(fp8 / fp4, docs/quantization.md); moving quantized experts between ranks is not "
                              "built: run without enable_eplb")
        self.num_redundant = num_redundant
        self.step_interval = step_interval
        self.steps = 0
        for layer in self.layers:
            layer.expert_load = torch.zeros(layer.num_experts, dtype=torch.long, device=backend.device)
            if layer.placement.num_slots != layer.num_experts + num_redundant:
                self._install(layer, compute_placement([1.0] * layer.num_experts, self.comm.world_size,
                                                       layer.num_experts + num_redundant))

    def step(self) -> int:
        """Count one engine step; rebalance (and return the experts moved) every step_interval steps."""
        self.steps += 1
        return self.rebalance() if self.steps % self.step_interval == 0 else 0

    def loads(self) -> torch.Tensor:
        """[layers, E] int64: the pairs routed to each logical expert since the last rebalance, summed over "ep"."""
        return self.comm.all_reduce(torch.stack([layer.expert_load for layer in self.layers])).cpu()

    def rebalance(self) -> int:
        loads = self.loads()
        moved = 0
        for layer, load in zip(self.layers, loads.tolist()):
            old = layer.placement
            new = compute_placement([float(v) for v in load], self.comm.world_size, old.num_slots, previous=old)
            if new != old and max(rank_loads(new, load)) < max(rank_loads(old, load)):
                moved += self._install(layer, new)
            layer.expert_load.zero_()
        return moved

    def _install(self, layer: nn.Module, new: ExpertPlacement) -> int:
        """Move this rank's share of the weights for `new` and hand them to the layer; the transfer count."""
        old, me = layer.placement, self.comm.rank
        transfers, local = plan_moves(old, new)
        w13, w2 = layer.w13, layer.w2
        n13, n2 = w13[0].numel(), w2[0].numel()
        send = [t for t in transfers if t.src == me]  # already in (dst, dst_slot) order
        recv = sorted((t for t in transfers if t.dst == me), key=lambda t: (t.src, t.dst_slot))
        flat = torch.cat([w13.reshape(w13.shape[0], -1), w2.reshape(w2.shape[0], -1)], dim=1)
        got = None
        if transfers:  # every rank computed the same plan: all take part, or none does
            out = flat[[t.src_slot for t in send]] if send else flat.new_zeros((0, flat.shape[1]))
            got = self.comm.all_to_all(out.contiguous(), [sum(t.dst == d for t in send) for d in range(new.ep_size)],
                                       [sum(t.src == s for t in recv) for s in range(new.ep_size)])
        per = new.slots_per_rank
        new13 = w13.new_empty((per, *w13.shape[1:]))
        new2 = w2.new_empty((per, *w2.shape[1:]))
        for d, i, j in local:
            if d == me:
                new13[j], new2[j] = w13[i], w2[i]
        for row, t in enumerate(recv):
            new13[t.dst_slot] = got[row, :n13].view(w13.shape[1:])
            new2[t.dst_slot] = got[row, n13:n13 + n2].view(w2.shape[1:])
        layer.install_placement(new, new13, new2)
        return len(transfers)
