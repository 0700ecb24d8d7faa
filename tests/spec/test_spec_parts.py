"""The n-gram drafter, the calibrator and the metrics on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import pytest
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
    fit = isotonic_increasing([0.1, 0.5, 0.3, 0.9], [1.0, 1.0, 1.0, 1.0])
    assert fit == pytest.approx([0.1, 0.4, 0.4, 0.9], abs=1e-12)
    assert isotonic_increasing([0.2, 0.9, 0.1], [1.0, 3.0, 1.0]) == pytest.approx([0.2, 0.7, 0.7], abs=1e-12)
    cal = SurvivalCalibrator(2, num_bins=4, refit_every=1)
    g = torch.Generator().manual_seed(0)
    conf = torch.rand(20000, generator=g)
    acc = torch.rand(20000, generator=g) < conf * 0.5  # over-confident drafts: true survival conf / 2
    cal.observe(torch.zeros(20000, dtype=torch.int64), conf, acc)
    est = cal.estimate(torch.zeros(4, dtype=torch.int64), torch.tensor([0.125, 0.375, 0.625, 0.875]))
    assert torch.allclose(est, torch.tensor([0.0625, 0.1875, 0.3125, 0.4375], dtype=torch.float64), atol=0.03)
    assert abs(cal.conditional_acceptance()[0] - 0.25) < 0.02


def test_plain_float_admission_equals_the_tensor_admission():
    """admit_lists (the per-step path for a few slots) chooses exactly what admit does: random survivals of ragged
    drafts, with ties (repeated and zero survivals), across cost tables where none, some or all slots pay, with and
    without the seconds every choice pays."""
    import random

    from deepinfer.spec.scheduler import admit, admit_array, admit_lists

    rng = random.Random(5)
    tables = [StepCostTable([1, 4096], [0.1, 0.101]), StepCostTable([1, 8, 64], [0.010, 0.020, 0.2]),
              StepCostTable([1, 2, 4096], [0.010, 0.020, 40.0])]
    admitted, admitted_full = set(), set()
    for trial in range(400):
        b, k = rng.randint(1, 8), rng.randint(1, 5)
        lens = [rng.randint(0, k) for _ in range(b)]
        pool = [0.0, 0.5, 0.9, 1.0, rng.random(), rng.random()]
        rows = [[rng.choice(pool) if rng.random() < 0.5 else rng.random() for _ in range(n)] for n in lens]
        # past a draft's length: zeros, or (a draft capped below what it holds) values the admission must not read
        pad = 0.0 if trial % 2 else rng.random()
        surv = torch.tensor([r + [pad] * (k - len(r)) for r in rows], dtype=torch.float64).view(b, k)
        cost = tables[trial % 3]
        spec_s = rng.choice([0.0, 0.002])
        fixed = rng.choice([0.0, 0.003])  # a step's fixed seconds (SlotPolicy._step_fixed_seconds)
        want = admit(surv, torch.tensor(lens), cost, b, float(b), draft_seconds=fixed,
                     speculation_seconds=spec_s).num_slots.tolist()
        assert admit_lists(rows, cost, b, float(b), speculation_seconds=spec_s, draft_seconds=fixed) == want, \
            (rows, trial)
        admitted.add(sum(want) == 0 if sum(lens) else None)
        # every draft held in full, survivals in [0, 1]: admit_array's fast path (no mask; in_unit: no clamp)
        full = [[rng.choice(pool) if rng.random() < 0.3 else rng.random() for _ in range(k)] for _ in range(b)]
        got = admit_array(np.asarray(full), np.full(b, k), cost, b, float(b), draft_seconds=fixed,
                          speculation_seconds=spec_s, in_unit=True)[0].tolist()
        assert got == admit_lists(full, cost, b, float(b), speculation_seconds=spec_s, draft_seconds=fixed), \
            (full, trial)
        admitted_full.add(sum(got) == 0)
    assert admitted >= {True, False}  # both "nothing pays" and "something pays" were compared
    assert admitted_full == {True, False}


def test_all_within_admits_every_slot_only_within_its_fraction_of_the_best_rate():
    """all_within (SlotPolicy.admit_all_below on the priced path): the two admission paths agree with it on; it
    admits every slot exactly where every slot's modelled rate is within that fraction of the best prefix's (checked
    against the rates recomputed here), and changes the choice in some trials and not in others."""
    import random

    from deepinfer.spec.scheduler import admit_array, admit_lists

    rng = random.Random(11)
    tables = [StepCostTable([1, 4096], [0.01, 0.01 + 4095e-6]), StepCostTable([1, 8, 64], [0.010, 0.011, 0.02])]
    flipped = kept = 0
    for trial in range(300):
        b, k = rng.randint(1, 12), rng.randint(1, 5)
        full = [[rng.choice([0.02, 0.1, rng.random()]) if rng.random() < 0.4 else 0.9 for _ in range(k)]
                for _ in range(b)]
        cost, fixed, within = tables[trial % 2], rng.choice([0.0, 0.005]), rng.choice([0.01, 0.02, 0.05])
        best, tok, sec = admit_array(np.asarray(full), np.full(b, k), cost, b, float(b), draft_seconds=fixed,
                                     in_unit=True)
        got = admit_array(np.asarray(full), np.full(b, k), cost, b, float(b), draft_seconds=fixed, in_unit=True,
                          all_within=within)[0].tolist()
        assert got == admit_lists(full, cost, b, float(b), draft_seconds=fixed, all_within=within), (full, trial)
        reach = np.cumprod(np.asarray(full), axis=1).sum()
        all_rate = (b + reach) / (cost.at(b + b * k) + fixed)
        if all_rate >= (1 - within) * tok / sec:
            assert got == [k] * b, trial
            flipped += best.tolist() != [k] * b
        else:
            assert got == best.tolist(), trial
            kept += 1
    assert flipped > 0 and kept > 0


def test_calibrator_list_paths_equal_the_tensor_paths():
    a, b = SurvivalCalibrator(3, refit_every=1), SurvivalCalibrator(3, refit_every=1)
    g = torch.Generator().manual_seed(3)
    slots = torch.randint(0, 3, (300,), generator=g)
    conf = torch.rand(300, generator=g, dtype=torch.float64)
    conf[:5] = torch.tensor([0.0, 1.0, 0.1, 0.7, 0.9999], dtype=torch.float64)  # bin edges
    acc = (torch.rand(300, generator=g) < 0.7).to(torch.float64)
    for i in range(0, 300, 5):
        a.observe(slots[i:i + 5], conf[i:i + 5], acc[i:i + 5])
        b.observe_lists(slots[i:i + 5].tolist(), conf[i:i + 5].tolist(), acc[i:i + 5].tolist())
    # the same counts; the slots' summed confidences (the prior's offset) add in another order: equal to 1e-12
    assert np.array_equal(a.trials, b.trials) and a.conditional_acceptance() == b.conditional_acceptance()
    assert np.allclose(a.conf_sums, b.conf_sums, rtol=1e-12, atol=0)
    assert np.allclose(a.table, b.table, rtol=0, atol=1e-12)
    est = a.estimate(slots, conf).tolist()
    assert [b.survival(int(s), float(c)) for s, c in zip(slots, conf)] == pytest.approx(est, rel=0, abs=1e-12)
    for _ in range(3):  # batches past 64 slots: observe_lists' numpy bincounts
        a.observe(slots, conf, acc)
        b.observe_lists(slots.tolist(), conf.tolist(), acc.tolist())
    a._refit()
    b._refit()
    assert np.array_equal(a.trials, b.trials) and np.allclose(a.accepts, b.accepts, rtol=0, atol=1e-9)
    assert np.allclose(a.table, b.table, rtol=0, atol=1e-12)


def test_the_calibrators_prior_is_shifted_by_the_slots_observed_offset():
    """Drafts of confidence ~0.55 accepted 90% of the time (the embedded model's MTP past slot 1): after 40
    observations every bin of that slot, seen or not, is priced up (the unseen 0.35 bin from its centre 0.35 to
    ~0.6), not only the bin they fell in; a slot whose drafts are calibrated keeps its centres; a slot never
    observed stays at them."""
    cal = SurvivalCalibrator(3, refit_every=1)
    g = torch.Generator().manual_seed(0)
    n = 40
    conf = 0.5 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64)
    cal.observe(torch.zeros(n, dtype=torch.int64), conf, (torch.arange(n) % 10 != 0).to(torch.float64))
    cal.observe(torch.ones(n, dtype=torch.int64), torch.full((n,), 0.95, dtype=torch.float64),
                (torch.arange(n) % 20 != 0).to(torch.float64))  # accepted 95% at 0.95: calibrated
    cal._refit()
    offset = (0.9 * n - float(conf.sum())) / (n + 2.0 * 10)
    assert offset == pytest.approx(0.23, abs=0.03)
    assert cal.survival(0, 0.35) == pytest.approx(0.35 + offset, abs=0.01)  # never observed in that bin
    assert cal.survival(0, 0.55) > 0.8 and cal.survival(0, 0.05) < 0.35
    assert cal.survival(1, 0.35) == pytest.approx(0.35, abs=0.01)
    assert cal.survival(2, 0.35) == pytest.approx(0.35) and cal.survival(2, 0.75) == pytest.approx(0.75)


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
    c = StepCostTable([1, 8, 64], [1.0, 0.9, 4.0])  # a point above a later one is timing noise: lowered to it
    got = c.cost(torch.tensor([1.0, 8.0, 36.0, 128.0]))
    assert torch.allclose(got, torch.tensor([0.9, 0.9, 2.45, 4.0 + 3.1 / 56 * 64], dtype=torch.float64))
    # one inflated point does not raise the points after it (the H100's drafting table, 2026-12-05: a chain of 5
    # at 4 sequences timed 2.11 ms, and a running maximum priced 4..128 sequences at 2.11 ms)
    assert StepCostTable([1, 2, 4, 8, 16], [0.62, 0.62, 2.11, 0.70, 0.75]).seconds == [0.62, 0.62, 0.70, 0.70, 0.75]
    # any shape, 0-d included, inside and past both ends; the array path gives `at`'s floats exactly
    for t in (torch.tensor(128.0), torch.tensor(0.5), torch.tensor(8.0), torch.tensor([[0.0, 3.0], [64.0, 70.0]])):
        got = c.cost(t)
        assert got.shape == t.shape and got.reshape(-1).tolist() == [c.at(x) for x in t.reshape(-1).tolist()], t
    # cost_range (the admission's memoised range) is cost_array's floats, read-only, and follows a replaced table
    r = c.cost_range(60, 9)
    assert r.tolist() == [c.at(float(x)) for x in range(60, 69)] and not r.flags.writeable
    assert c.cost_range(60, 9) is r
    c.seconds = [2.0, 2.0, 8.0]
    assert c.cost_range(60, 9).tolist() == [c.at(float(x)) for x in range(60, 69)] != r.tolist()


def test_many_requests_outcomes_count_as_the_per_slot_loop_does():
    """The array paths for many requests (SpecMetrics.record past 16 requests, SurvivalCalibrator.observe_verified
    past 64 outcomes) count what the per-request, per-slot loops count."""
    from deepinfer.spec.metrics import SpecMetrics

    g = np.random.default_rng(5)
    for b in (3, 17, 256):
        verified = g.integers(0, 6, b).tolist()
        accepted = [int(g.integers(0, v + 1)) for v in verified]
        conf = [g.random(5).tolist() for _ in range(b)]
        m = SpecMetrics(5)
        m.record(verified, accepted, sum(verified))
        reached, acc = [0] * 5, [0] * 5
        slots, confs, outcome = [], [], []
        for row, v, a in zip(conf, verified, accepted):
            for j in range(min(v, a + 1)):
                reached[j] += 1
                acc[j] += 1 if j < a else 0
                slots.append(j)
                confs.append(row[j])
                outcome.append(1.0 if j < a else 0.0)
        assert m.reached == reached and m.accepted == acc
        x, y = SurvivalCalibrator(5, refit_every=1), SurvivalCalibrator(5, refit_every=1)
        # in three verifications (kept until the refit, then counted together), each row's confidences cut to what
        # it verified (as the pipeline passes them), one verification with nothing reached
        x.observe_verified([], [], [])
        cut = [row[:v] for row, v in zip(conf, verified)]
        for lo, hi in ((0, b // 3), (b // 3, b - 1), (b - 1, b)):
            x.observe_verified(cut[lo:hi], verified[lo:hi], accepted[lo:hi])
        assert x.num_observed == len(slots)
        y.observe_lists(slots, confs, outcome)
        x._refit()
        y._refit()
        assert np.array_equal(x.trials, y.trials) and np.allclose(x.accepts, y.accepts, rtol=0, atol=1e-9)
        assert np.allclose(x.conf_sums, y.conf_sums, rtol=1e-12, atol=0)
    # a row shorter than its outcomes counts zeros past its confidences (as the padded matrix did before)
    x, y = SurvivalCalibrator(5, refit_every=1), SurvivalCalibrator(5, refit_every=1)
    x.observe_verified([[0.9], [0.5, 0.4]], [3, 2], [3, 0])
    y.observe_lists([0, 1, 2, 0], [0.9, 0.0, 0.0, 0.5], [1.0, 1.0, 1.0, 0.0])
    x._refit()
    y._refit()
    assert np.array_equal(x.trials, y.trials) and np.array_equal(x.accepts, y.accepts)


def test_step_phases_sum_difference_and_describe():
    """StepPhases (spec/step_phases.py): per-kind sums, a snapshot's difference, two records together, ms a step by
    phase with their total, and an unknown phase named in the error."""
    from deepinfer.spec.step_phases import PHASES, StepPhases

    ph = StepPhases()
    ph.add("one_sync", {"schedule": 0.001, "wait": 0.003}, 10)
    before = ph.snapshot()
    ph.add("one_sync", {"schedule": 0.002, "slots": 0.0005, "wait": 0.001}, 20)
    ph.add("plain", {"launch": 0.004}, 4)
    new = ph.since(before)
    assert new.steps == {"one_sync": 1, "plain": 1} and new.tokens == {"one_sync": 20, "plain": 4}
    rows = new.per_step_ms()
    assert rows["one_sync"]["schedule"] == pytest.approx(2.0) and rows["one_sync"]["wait"] == pytest.approx(1.0)
    assert rows["one_sync"]["total"] == pytest.approx(3.5) and rows["plain"]["total"] == pytest.approx(4.0)
    both = new.plus(before)
    assert both.steps == ph.steps and both.tokens == ph.tokens
    assert both.seconds == pytest.approx(ph.seconds)
    assert both.per_step_ms()["one_sync"]["tokens"] == pytest.approx(15.0)
    assert new.plus(None) is new
    assert "one_sync: 1 steps, 20.0 tok, 3.500 ms" in new.describe() and StepPhases().describe() == "no steps"
    assert set(rows["plain"]) == {"steps", "tokens", "total", *PHASES}
    # parts of launch: beside the phases, not in their total
    ph.add("plain", {"launch": 0.004, "build": 0.001, "forward": 0.002}, 4)
    part = ph.since(before).per_step_ms()["plain"]
    assert part["build"] == pytest.approx(0.5) and part["forward"] == pytest.approx(1.0) and "stage" not in part
    assert part["total"] == pytest.approx(4.0)
    assert "(launch: build 0.500, forward 1.000)" in ph.since(before).describe()
    with pytest.raises(ValueError, match="'compile'"):
        ph.add("host", {"compile": 1.0}, 1)
