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


def _reference_proposal(tokens: list[int], k: int, max_ngram=4, min_ngram=1, lookback=2048):
    """The drafter's rule written plainly (its first, pure-Python implementation): the longest suffix n-gram with
    an earlier occurrence proposes what followed its most recent one; confidence = agreement of all occurrences."""
    if k <= 0 or len(tokens) < 2:
        return [], []
    hist = tokens[-lookback:]
    for n in range(min(max_ngram, len(hist) - 1), min_ngram - 1, -1):
        suffix = hist[len(hist) - n:]
        starts = [i for i in range(len(hist) - n - 1, -1, -1) if hist[i:i + n] == suffix]
        if not starts:
            continue
        out = hist[starts[0] + n: starts[0] + n + k]
        conf = []
        for j, tok in enumerate(out):
            follow = [hist[s + n + j] for s in starts if s + n + j < len(hist)]
            conf.append(sum(1 for t in follow if t == tok) / max(1, len(follow)))
        return list(out), conf
    return [], []


def test_ngram_vectorised_search_equals_the_plain_rule():
    import random

    rng = random.Random(7)
    d = NgramDrafter(lookback=300)
    for trial in range(300):
        vocab = rng.choice([3, 10, 50, 1000])  # small vocabularies repeat a lot, large ones rarely
        n = rng.randrange(0, 700)
        toks = [rng.randrange(vocab) for _ in range(n)]
        if trial % 3 == 0 and n > 20:  # a copied span, as in code
            a = rng.randrange(n - 10)
            toks += toks[a: a + rng.randrange(2, 10)]
        k = rng.randrange(0, 6)
        p = d.propose(toks, k)
        assert (p.tokens, p.confidence) == _reference_proposal(toks, k, lookback=300), (trial, n, k)


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
    plain, zeros = SpecMetrics(3), SpecMetrics(3)  # a step of 4 plain decodes, as record_plain and as record
    plain.record_plain(4)
    zeros.record(torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64), 0)
    assert plain == zeros and plain.steps == 1 and plain.request_steps == 4 and plain.tau == 1.0


def test_cost_table_interpolates_and_is_monotone():
    c = StepCostTable([1, 8, 64], [1.0, 0.9, 4.0])  # a timing dip is flattened
    got = c.cost(torch.tensor([1.0, 8.0, 36.0, 128.0]))
    assert torch.allclose(got, torch.tensor([1.0, 1.0, 2.5, 4.0 + 3.0 / 56 * 64], dtype=torch.float64))
