"""EPLB's placement algorithm (in-process) and the -1 (another rank's expert) skipping of the MoE ops on the CPU.

Placement: every logical expert keeps >= 1 replica, the slot count is right, the heaviest rank after balancing
is no heavier than before on skewed loads (and strictly lighter where replicas help), the result is
deterministic, and a re-balance keeps an expert that stays on a rank in its slot. Skipping: each op's
`experts` with some ids set to -1 equals a per-pair reference that drops those pairs.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.backend import MoESpec, NativeMoE, RouterSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.invariant import InvariantMoE
from deepinfer.errors import ConfigError
from deepinfer.models.layers.experts import ExpertPlacement
from deepinfer.models.layers.moe_dispatch import ExpertParallelRouting
from deepinfer.parallel.eplb import (
    balanced_packing,
    compute_placement,
    plan_moves,
    rank_loads,
    replicate_experts,
)

SKEWED = [
    [1000.0, 10, 10, 10, 10, 10, 10, 10],  # one hot expert
    [400.0, 300, 200, 100, 1, 1, 1, 1],  # hot experts crowded on rank 0 by the contiguous layout
    [5.0, 5, 5, 5, 90, 80, 70, 60],
]


@pytest.mark.parametrize("load", SKEWED)
@pytest.mark.parametrize("ep,redundant", [(2, 0), (2, 2), (4, 4), (4, 0)])
def test_placement_is_valid_balanced_and_deterministic(load, ep, redundant):
    n = len(load)
    before = ExpertPlacement.contiguous(n, ep)
    p = compute_placement(load, ep, n + redundant)
    assert p.num_slots == n + redundant and p.slots_per_rank == (n + redundant) // ep
    assert sorted(set(p.slot_experts)) == list(range(n))  # every logical expert has a replica
    assert sum(p.replica_counts()) == n + redundant
    assert max(rank_loads(p, load)) <= max(rank_loads(before, load))
    assert compute_placement(list(load), ep, n + redundant) == p  # same loads, same placement


def test_replicas_go_to_the_hot_expert_and_lower_the_peak():
    load = SKEWED[0]
    assert replicate_experts(load, 10) == [3] + [1] * 7  # 1000/2 = 500 > 10, then 1000/3 = 333 > 10
    before = max(rank_loads(compute_placement(load, 2, 8), load))
    after = max(rank_loads(compute_placement(load, 2, 10), load))
    assert after < before  # one rank cannot go below 1000 without a replica; two replicas split it
    assert balanced_packing([5.0, 4, 3, 3, 2, 1], 2) == [0, 1, 1, 0, 1, 0]  # LPT: 5+3+1 = 9 vs 4+3+2 = 9


def test_rebalance_keeps_staying_experts_in_their_slots_and_plans_moves():
    old = ExpertPlacement.contiguous(8, 2)
    new = compute_placement(SKEWED[1], 2, 8, previous=old)
    for r in range(2):
        for j, e in enumerate(new.rank_experts(r)):
            if e in old.rank_experts(r):
                assert old.rank_experts(r)[j] == e or new.rank_experts(r).count(e) > 1
    transfers, local = plan_moves(old, new)
    assert transfers, "the skewed load must move experts"
    for t in transfers:
        assert old.rank_experts(t.src)[t.src_slot] == t.expert == new.rank_experts(t.dst)[t.dst_slot]
        assert t.expert not in old.rank_experts(t.dst)
    assert len(transfers) + len(local) == new.num_slots


def test_placement_errors_name_the_problem():
    with pytest.raises(ConfigError, match="split evenly"):
        ExpertPlacement.contiguous(6, 4)
    with pytest.raises(ConfigError, match="without a slot"):
        ExpertPlacement(4, 2, (0, 1, 1, 2))
    with pytest.raises(ConfigError, match="split evenly"):
        compute_placement([1.0] * 8, 4, 10)


def test_routing_maps_each_pair_to_exactly_one_rank():
    p = compute_placement(SKEWED[0], 2, 10)  # expert 0 has three replicas
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 8, (13, 3), generator=g)
    ids[:, 0] = 0
    routes = [ExpertParallelRouting(p, r, "cpu") for r in range(2)]
    locals_ = [rt.local_ids(ids) for rt in routes]
    owned = sum((lo >= 0).long() for lo in locals_)
    assert bool((owned == 1).all())
    for r, lo in enumerate(locals_):  # a local slot holds the routed logical expert
        mine = torch.tensor(p.rank_experts(r))
        sel = lo >= 0
        assert torch.equal(mine[lo[sel]], ids[sel])
    replicas_used = {int(rt.base + lo[t, 0]) for rt, lo in zip(routes, locals_) for t in range(13) if lo[t, 0] >= 0}
    assert len(replicas_used) == 3  # the hot expert's tokens spread over all its replicas
    load = torch.zeros(8, dtype=torch.long)
    for rt, lo in zip(routes, locals_):
        rt.count(load, ids, lo)
    assert torch.equal(load, torch.bincount(ids.reshape(-1), minlength=8))


# ---------------------------------------------------------------- -1 skipping on the CPU ops


def _reference(x, w13, w2, weights, ids):
    """Per pair, dropping -1 pairs: sum_j w * down(silu(gate x) * up x) in fp32."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float64)
    inter = w13.shape[1] // 2
    for t in range(ids.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if e < 0:
                continue
            h = F.linear(x[t].double(), w13[e].double())
            a = F.silu(h[:inter]) * h[inter:]
            out[t] += float(weights[t, j]) * F.linear(a, w2[e].double())
    return out


def _ops(spec):
    cpu = CPUBackend()
    yield "native", NativeMoE(spec)
    yield "cpu", cpu.make_moe(spec)  # dense below the work threshold, pairs at <= 4 pairs
    big = CPUBackend()
    big.moe_dense_max_work = 0  # the per-expert loop
    yield "cpu-loop", big.make_moe(spec)
    yield "invariant", InvariantMoE(spec)


@pytest.mark.parametrize("tokens", [0, 1, 2, 9])
def test_experts_skip_minus_one_ids(tokens):
    router = RouterSpec(8, 2, "softmax", "greedy")
    spec = MoESpec(router=router, hidden_size=16, intermediate_size=8, num_local_experts=3)
    g = torch.Generator().manual_seed(1)
    w13 = torch.randn(3, 16, 16, generator=g) * 0.2
    w2 = torch.randn(3, 16, 8, generator=g) * 0.2
    x = torch.randn(tokens, 16, generator=g)
    ids = torch.randint(-1, 3, (tokens, 2), generator=g)
    if tokens:
        ids[0] = -1  # a token none of whose experts is here
    weights = torch.rand(tokens, 2, generator=g)
    ref = _reference(x, w13, w2, weights, ids)
    for name, op in _ops(spec):
        op.load_experts(w13, w2)
        out = op.experts(x, weights, ids)
        assert out.shape == (tokens, 16), name
        torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
        if tokens:
            assert bool((out[0] == 0).all()), name


def test_replace_experts_swaps_weights_in_place():
    spec = MoESpec(router=RouterSpec(4, 2, "softmax", "greedy"), hidden_size=8, intermediate_size=4)
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 4, generator=g)
    n13, n2 = torch.randn(4, 8, 8, generator=g), torch.randn(4, 8, 4, generator=g)
    x, ids, wt = torch.randn(5, 8, generator=g), torch.randint(0, 4, (5, 2), generator=g), torch.rand(5, 2, generator=g)
    for name, op in _ops(spec):
        op.load_experts(w13.clone(), w2.clone())
        op.replace_experts(n13, n2)
        torch.testing.assert_close(op.experts(x, wt, ids).double(), _reference(x, n13, n2, wt, ids), atol=1e-5,
                                   rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
