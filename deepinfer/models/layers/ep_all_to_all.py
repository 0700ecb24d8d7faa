"""Expert parallelism's all-to-all token dispatch and combine, and the choice between it and the all-gather path
(docs/parallelism.md, "Dispatch modes").

The all-gather path (moe_dispatch.gather_replicas + one all-reduce over "ep") moves every replica's hidden states
to every rank and sums [all tokens, D] over every rank: few collectives, traffic that grows with the world size.
The all-to-all path moves each routed (token, slot) pair only to the rank whose physical slot computes it and its
output only back:

1. share: a replica's tokens are split over its tp ranks (contiguous rows), so each pair is sent exactly once;
2. route the share (the same router as one process: routing is per token), map each pair to one physical slot
   (`ExpertParallelRouting.physical`: the placement's replicas, chosen deterministically);
3. sort the pairs by physical slot (so by destination rank, then its local slot) and exchange the per-slot counts
   in one small all_to_all ([ep * slots_per_rank] int64 each way, one host sync for the split sizes);
4. all_to_all the pairs' hidden states (uneven splits); the receiver knows each row's local slot from the counts,
   runs its experts on them (the backend's `MoEOp.experts`, k = 1, weight 1: the bare expert output) and sends
   the outputs back with the reverse all_to_all;
5. the source combines: each pair's output times its routing weight in fp32, summed over the token's slots in
   slot order, cast to the activation dtype once (the order of the native op, backend/native/moe.py), then the
   shared experts added; with tp > 1 the replica's shares (and the shared experts' tp-partials) are summed by
   one all-reduce over "tp".

Why not bitwise equal to the all-gather path: that path sums each rank's local slots first and then the ranks'
partials (an all-reduce, in the transport's order), and the CPU op may compute a batch with one dense GEMM over
every expert; the two paths round differently in the last bits (fp32: within 2e-5, tested), though each is
deterministic for a given layout and batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import Communicator
from deepinfer.errors import ConfigError

EP_DISPATCH_MODES = ("auto", "all_to_all", "all_gather")
# auto: the all-to-all path from this many tokens per forward (summed over the data-parallel replicas). Not a
# measured break-even (issue 20 measures on GPUs): decode batches stay on the all-gather path (fewer collectives,
# no per-slot count exchange), prefill chunks move only their routed pairs.
DEFAULT_ALL_TO_ALL_MIN_TOKENS = 256


@dataclass(frozen=True)
class EPDispatch:
    """How an expert-parallel MoE layer moves its tokens (EngineConfig.ep_dispatch / ep_all_to_all_min_tokens)."""

    mode: str = "auto"
    all_to_all_min_tokens: int = DEFAULT_ALL_TO_ALL_MIN_TOKENS

    def __post_init__(self) -> None:
        if self.mode not in EP_DISPATCH_MODES:
            raise ConfigError(f"ep_dispatch={self.mode!r}: choose one of {', '.join(EP_DISPATCH_MODES)}")
        n = self.all_to_all_min_tokens
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ConfigError(f"ep_all_to_all_min_tokens={n!r} must be an integer >= 1 (tokens per forward, "
                              "summed over the data-parallel replicas)")

    def use_all_to_all(self, tokens: int) -> bool:
        """The path for a forward of `tokens` tokens over every replica (the same number on every rank)."""
        if self.mode == "auto":
            return tokens >= self.all_to_all_min_tokens
        return self.mode == "all_to_all"


def replica_counts(x: torch.Tensor, dp: Communicator) -> list[int]:
    """Every data-parallel replica's token count (one small all_gather, a host sync; none with one replica)."""
    if dp.world_size == 1:
        return [x.shape[0]]
    return dp.all_gather(torch.tensor([x.shape[0]], dtype=torch.long, device=x.device)).tolist()


def choose_path(layer, x: torch.Tensor) -> tuple[bool, list[int] | None]:
    """(whether this forward of `layer` takes the all-to-all path, the replicas' token counts when they were
    gathered to decide: the all-gather path reuses them). The same answer on every rank: forced modes need no
    count, auto sums the counts gathered over "dp" (with one replica, every "ep" rank holds the same rows).
    Counts the path taken in layer.dispatch_counts (which path ran: stats, tests)."""
    counts = replica_counts(x, layer.dp) if layer.ep_dispatch.mode == "auto" else None
    use = layer.ep_dispatch.use_all_to_all(sum(counts) if counts is not None else 0)
    key = "all_to_all" if use else "all_gather"
    layer.dispatch_counts[key] = layer.dispatch_counts.get(key, 0) + 1
    return use, counts


def token_share(rows: int, tp: Communicator) -> slice:
    """This tp rank's contiguous share of its replica's rows (every tp rank holds them all): each routed pair
    is dispatched by exactly one rank."""
    n, r = tp.world_size, tp.rank
    return slice(rows * r // n, rows * (r + 1) // n)


def dispatch_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, routing, ep: Communicator,
                     op, load: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum [T, D] (x's dtype) for this rank's rows x [T, D] with their routing
    (weights [T, k] fp32, logical ids [T, k]), computed by whichever ranks hold the chosen slots.

    Collective over "ep": every rank calls it once per layer forward, with T = 0 where it has no tokens (the
    counts it sends are zeros). load [E] += the pairs routed to each logical expert (this rank's pairs only, so
    summed over "ep" every pair counts once)."""
    t, k = ids.shape
    d, s = x.shape[1], routing.slots
    phys = routing.physical(ids, ep.rank).reshape(-1)  # [T * k] global physical slot of each pair
    if load is not None:
        load.scatter_add_(0, ids.reshape(-1), torch.ones_like(phys, dtype=load.dtype))
    order = torch.argsort(phys, stable=True)  # pairs grouped by destination rank, then by its local slot
    send_counts = torch.bincount(phys, minlength=ep.world_size * s)
    recv_counts = ep.all_to_all(send_counts)  # [ep * s]: block j = what rank j sends to each of my slots
    per_rank = torch.stack([send_counts.view(-1, s).sum(1), recv_counts.view(-1, s).sum(1)]).tolist()
    send_splits, recv_splits = per_rank
    recv_x = ep.all_to_all(x.index_select(0, order // k), send_splits, recv_splits)
    local = torch.arange(s, device=x.device).repeat(ep.world_size).repeat_interleave(recv_counts)
    y = op.experts(recv_x, torch.ones((recv_x.shape[0], 1), dtype=torch.float32, device=x.device),
                   local.unsqueeze(1))
    back = ep.all_to_all(y, recv_splits, send_splits)  # [T * k, D]: the outputs in this rank's send order
    buf = torch.zeros((t * k, d), dtype=torch.float32, device=x.device)
    buf[order] = back.float() * weights.reshape(-1, 1).float()[order]
    return buf.view(t, k, d).sum(dim=1).to(x.dtype)


def combine_share(x: torch.Tensor, routed: torch.Tensor, share: slice, shared_experts, tp: Communicator
                  ) -> torch.Tensor:
    """The layer's output for the replica's rows x [T, D]: this rank's routed share put in its rows, plus the
    shared experts (a tp-partial under tensor parallelism), summed over "tp" once when tp > 1."""
    if tp.world_size == 1:
        out = routed
    else:
        out = x.new_zeros(x.shape)
        out[share] = routed
    if shared_experts is not None:
        out = out + shared_experts(x)  # the routed sum rounded to x's dtype, then the add (as one process)
    if tp.world_size > 1 and out.numel():  # the tp ranks of a replica hold the same row count
        out = tp.all_reduce(out)
    return out


def set_ep_dispatch(model: torch.nn.Module, dispatch: EPDispatch) -> int:
    """Give every expert-parallel MoE layer of `model` this dispatch; the number of layers set."""
    n = 0
    for m in model.modules():
        if getattr(m, "expert_parallel", False) and hasattr(m, "ep_dispatch"):
            m.ep_dispatch = dispatch
            n += 1
    return n


class IdleReplicaForward:
    """Context for a data-parallel replica's dummy forward (worker/dummy_forward.py): its expert-parallel MoE
    layers take part in the collectives with zero tokens (nothing dispatched, nothing counted for EPLB), so the
    other replicas' collectives meet and the loads stay exact."""

    def __init__(self, model: torch.nn.Module):
        self.layers = [m for m in model.modules() if getattr(m, "expert_parallel", False)
                       and hasattr(m, "idle_replica")]

    def __enter__(self) -> IdleReplicaForward:
        for m in self.layers:
            m.idle_replica = True
        return self

    def __exit__(self, *exc) -> None:
        for m in self.layers:
            m.idle_replica = False


def idle_forward(model: torch.nn.Module, run):
    """`run` (the dummy forward) wrapped so the MoE layers see an idle replica while it runs."""
    def call() -> None:
        with IdleReplicaForward(model):
            run()
    return call
