"""The n-gram drafter, the calibrator and the metrics on small hand-checked cases."""

from __future__ import annotations

import torch

from deepinfer.spec.confidence import SurvivalCalibrator, isotonic_increasing
from deepinfer.spec.metrics import SpecMetrics
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.spec.scheduler import StepCostTable


def test_ngram_proposes_the_continuation_of_the_longest_match():
    d = NgramDrafter(max_ngram=3)
    toks = [1, 2, 3, 4, 5, 9, 1, 2, 3]
    p = d.propose(toks, 3)
    assert p.tokens == [4, 5, 9] and p.confidence == [1.0, 1.0, 1.0]
    assert d.propose([7, 8], 2).tokens == []  # no earlier occurrence
    p = d.propose([5, 1, 5, 2, 5], 1)  # suffix "5" seen twice, followed by 2 (recent) and 1
    assert p.tokens == [2] and p.confidence == [0.5]


def test_isotonic_and_calibrator_converge_to_observed_rates():
    fit = isotonic_increasing(torch.tensor([0.1, 0.5, 0.3, 0.9]), torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert torch.allclose(fit, torch.tensor([0.1, 0.4, 0.4, 0.9], dtype=torch.float64), atol=1e-6)
    cal = SurvivalCalibrator(2, num_bins=4, refit_every=1)
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(20000, generator=g)
    acc = torch.rand(20000, generator=g) < conf * 0.5  # over-confident drafts: true survival conf / 2
    cal.observe(torch.zeros(20000, dtype=torch.int64), conf, acc)
    est = cal.estimate(torch.zeros(4, dtype=torch.int64), torch.tensor([0.125, 0.375, 0.625, 0.875]))
    assert torch.allclose(est, torch.tensor([0.0625, 0.1875, 0.3125, 0.4375], dtype=torch.float64), atol=0.03)
    assert abs(cal.conditional_acceptance()[0] - 0.25) < 0.02


def test_metrics_tau_and_conditional_acceptance():
    m = SpecMetrics(3)
    m.record(torch.tensor([3, 2, 0]), torch.tensor([3, 0, 0]), drafted=9)
    assert m.tau == 1 + 3 / 3 and m.acceptance_rate == 3 / 5
    assert m.conditional_acceptance() == [0.5, 1.0, 1.0] and m.mean_budget == 5


def test_cost_table_interpolates_and_is_monotone():
    c = StepCostTable([1, 8, 64], [1.0, 0.9, 4.0])  # a timing dip is flattened
    got = c.cost(torch.tensor([1.0, 8.0, 36.0, 128.0]))
    assert torch.allclose(got, torch.tensor([1.0, 1.0, 2.5, 4.0 + 3.0 / 56 * 64], dtype=torch.float64))
