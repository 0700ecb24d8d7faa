"""The chain model's reach from the recent drafts' confidences (spec/recent_drafts.py, SlotPolicy.recent_drafts)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.recent_drafts import RecentDrafts
from tests.spec.chain_policies import chain_policy


def _reach_by_loops(drafts: list[list[float]], table: list[list[float]], k: int, fallback: list[float]) -> list[float]:
    """The definition, one draft and one slot at a time."""
    nb, slots = len(table[0]), len(table)
    out = [0.0] * k
    for conf in drafts:
        reach = 1.0
        for j in range(k):
            if j < len(conf):
                reach *= table[min(j, slots - 1)][min(max(int(conf[j] * nb), 0), nb - 1)]
            else:
                reach *= fallback[j]
            out[j] += reach / len(drafts)
    return out


def test_expected_reach_is_the_mean_over_drafts_of_the_products():
    rng = random.Random(7)
    k, slots, nb = 5, 4, 10
    table = [[rng.random() for _ in range(nb)] for _ in range(slots)]
    fallback = [rng.random() for _ in range(k)]
    cal = SurvivalCalibrator(num_slots=slots, num_bins=nb)
    cal.table = np.array(table)
    rec = RecentDrafts(steps=3)
    assert rec.expected_reach(cal, k, fallback) is None
    every = []
    for step in range(5):  # lists, then arrays; the first two steps fall out of the ring of 3
        n = rng.randint(1, 6)
        conf = [[rng.random() for _ in range(k)] for _ in range(n)]
        lens = [rng.randint(1, k) for _ in range(n)]
        if step % 2:
            rec.add(np.array(conf), np.array(lens))
        else:
            rec.add(conf, lens)
        every.append([c[:n_] for c, n_ in zip(conf, lens)])
    kept = [d for step in every[-3:] for d in step]
    got = rec.expected_reach(cal, k, fallback)
    assert got == pytest.approx(_reach_by_loops(kept, table, k, fallback), rel=1e-12)
    with pytest.raises(ValueError, match="steps >= 1"):
        RecentDrafts(steps=0)


def test_sampled_reach_prices_a_step_shaped_survival_at_its_mean():
    """Drafts accepted 0.98 of the time at confidence 0.5 and above and 0.2 below, confidences spread evenly over
    [0, 1]: each slot survives 0.59 of the time. The default model prices the slot at the mean confidence 0.5
    (0.98); the sampled reach matches a draw of the drafts' outcomes."""
    k, n = 3, 2000
    centres = [(b + 0.5) / 10 for b in range(10)]

    def rate(c: float) -> float:
        return 0.98 if c >= 0.5 else 0.2

    cal = SurvivalCalibrator(num_slots=k, prior_weight=0.01)
    for j in range(k):
        for c in centres:
            cal.observe(torch.full((n,), j), torch.full((n,), c, dtype=torch.float64),
                        (torch.arange(n) < rate(c) * n).to(torch.float64))
    base = chain_policy([0.9] * k, one=1e-3, full=2e-3, k=k, calibrator=cal, mean_confidence=[0.5] * k)
    sampled = chain_policy([0.9] * k, one=1e-3, full=2e-3, k=k, calibrator=cal, mean_confidence=[0.5] * k,
                           recent_drafts=RecentDrafts(steps=8))
    rng = random.Random(3)
    drafts = [[rng.choice(centres) for _ in range(k)] for _ in range(64)]
    held = [HeldDraft(None, 0, [0] * k, c) for c in drafts]
    sampled.counts(held, [k] * len(held), len(held), len(held))  # a priced admission keeps its drafts
    assert len(sampled.recent_drafts) == 1
    # the truth for these drafts: a chain's expected tokens a sequence, by drawing their outcomes
    draws = 20000
    truth = [0.0] * (k + 1)
    for _ in range(draws):
        emitted = 1
        for c in drafts[rng.randrange(len(drafts))]:
            if rng.random() >= rate(c):
                break
            emitted += 1
        for chain in range(k + 1):
            truth[chain] += min(emitted, chain + 1) / draws
    old, _ = base.chain_model(1)
    new, _ = sampled.chain_model(1)
    assert old[1] == pytest.approx(1.98, abs=0.01)  # the plateau: s(0.5) = 0.98
    assert new == pytest.approx(truth, abs=0.03)
    assert old[k] > truth[k] + 0.8  # the default over-promises a chain of 3 by most of a token
