"""The confidence scheduler keeps verification lossless, and the test can see a rule that peeks.

Setup (DSpark's example): target p = (0.7, 0.3), draft q = (0.5, 0.5). A rule whose admission depends
on the sampled outcome biases the emitted pmf to (0.85, 0.15); both of the classic ways are shown and
detected: (a) admitting the slot only when its acceptance uniform is small (peeking at the draw) and
(b) admitting a random draft by a confidence of the drawn token. The real scheduler (admit()) with
calibrated survivals and adversarial token-dependent confidences on deterministic drafts passes.
"""

from __future__ import annotations

import torch
from test_rejection_lossless import ALPHA, chi2_pvalue, draw_drafts

from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.rejection import STREAM_ACCEPT, STREAM_RESAMPLE, draw_from_rows, rejection_verify, uniforms
from deepinfer.spec.scheduler import StepCostTable, admit

N = 1_000_000
P = torch.tensor([[0.7, 0.3], [0.7, 0.3]], dtype=torch.float64)
Q = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
COST = StepCostTable([1, N // 5, N // 5 + N // 10, 2 * N], [1.0, 1.01, 1.02, 20.0])  # cheap up to half the rows


def verify_with_admission(draft, admitted, seeds, q):
    """One slot per row; rows not admitted verify nothing and draw from p."""
    n = draft.shape[0]
    v = rejection_verify(P, draft, admitted.to(torch.int64), seeds, torch.zeros(n, dtype=torch.int64), q,
                         p_rows=torch.arange(2).expand(n, -1), q_rows=None if q is None else torch.zeros(n, 1, dtype=torch.int64))
    return v.tokens[:, 0]


def test_peeking_rule_is_caught():
    n = N // 5  # a 0.15 bias needs few draws to show
    seeds = torch.arange(n)
    draft = torch.zeros(n, 1, dtype=torch.int64)  # a deterministic draft of token 0
    u = uniforms(seeds.unsqueeze(1), torch.zeros(n, 1, dtype=torch.int64), STREAM_ACCEPT).squeeze(1)
    admitted = u < 0.5  # peeks at the acceptance draw
    # a row not admitted draws fresh noise (another step's), as a retry would
    fresh = draw_from_rows(P[:1], torch.zeros(n, dtype=torch.int64), uniforms(seeds, torch.ones(n, dtype=torch.int64), STREAM_RESAMPLE))
    tok = torch.where(admitted, verify_with_admission(draft, admitted, seeds, None), fresh)
    counts = torch.bincount(tok, minlength=2)
    assert abs(counts[0].item() / n - 0.85) < 0.005
    assert chi2_pvalue(counts, P[0]) < 1e-12


def test_token_dependent_admission_of_random_drafts_is_caught():
    n = N // 5
    seeds = torch.arange(n)
    draft = draw_drafts(Q, n, seeds, 0)
    conf = torch.where(draft[:, 0] == 0, 0.9, 0.1)  # a confidence of the drawn token
    adm = admit(conf.unsqueeze(1), torch.ones(n, dtype=torch.int64), COST, base_tokens=n, base_yield=n)
    tok = verify_with_admission(draft, adm.num_slots, seeds, Q)
    counts = torch.bincount(tok, minlength=2)
    assert 0.05 < adm.num_slots.float().mean().item() < 0.95  # the scheduler did discriminate
    assert chi2_pvalue(counts, P[0]) < 1e-12


def test_scheduler_on_deterministic_drafts_is_lossless_with_adversarial_confidence():
    """Multi-slot, scheduler on, calibrated online over steps, confidences that depend on the drafted token
    (high for the token the target rarely emits): every slot's emitted tokens follow p exactly."""
    k, vocab, steps, batch = 3, 20, 5, N // 5
    g = torch.Generator().manual_seed(1)
    p = torch.randn(k + 1, vocab, generator=g, dtype=torch.float64).mul(1.5).softmax(-1)
    cal = SurvivalCalibrator(k, num_bins=8, refit_every=1)
    cost = StepCostTable([1, batch, 2 * batch, batch * (k + 1)], [1.0, 1.5, 1.6, 6.0])
    counts = torch.zeros(k + 1, vocab, dtype=torch.int64)
    admitted_total = 0
    for step in range(steps):
        seeds = torch.randint(-2**62, 2**62, (batch,), generator=g)
        # deterministic drafter: a token per slot chosen from the row's seed parity (a function of context)
        low, high = p[:k].argmin(-1), p[:k].argmax(-1)
        draft = torch.where((seeds % 2 == 0).unsqueeze(1), low.expand(batch, -1), high.expand(batch, -1))
        conf = torch.where(draft == low, 0.95, 0.2)  # adversarial: confident exactly when wrong
        surv = cal.estimate(torch.arange(k).expand(batch, -1), conf)
        adm = admit(surv, torch.full((batch,), k), cost, base_tokens=batch, base_yield=batch)
        admitted_total += int(adm.num_slots.sum())
        v = rejection_verify(p, draft, adm.num_slots, seeds, torch.full((batch,), 3 + step), None,
                             p_rows=torch.arange(k + 1).expand(batch, -1))
        for j in range(k + 1):
            reach = v.num_accepted >= j
            counts[j] += torch.bincount(v.tokens[reach, j], minlength=vocab)
        # calibrate: outcomes of verified slots whose predecessors were accepted
        slot = torch.arange(k).expand(batch, -1)
        seen = slot < torch.minimum(v.num_accepted + 1, adm.num_slots).unsqueeze(1)
        cal.observe(slot[seen], conf[seen], (slot < v.num_accepted.unsqueeze(1))[seen])
    assert 0 < admitted_total < steps * batch * k  # neither nothing nor everything
    assert int(counts.sum()) >= N
    for j in range(k + 1):
        if counts[j].sum() > 1000:
            assert chi2_pvalue(counts[j], p[j]) > ALPHA, f"slot {j}"
    # calibration learnt not to trust the adversary: its 0.95-confident drafts (the rare token) get a
    # survival near the observed slot-0 acceptance, far below 0.95
    est = cal.estimate(torch.zeros(2, dtype=torch.int64), torch.tensor([0.95, 0.2]))
    observed = cal.conditional_acceptance()[0]
    assert est[0] < 0.5 and abs(est[0] - observed) < 0.05


def test_admit_budget_shrinks_under_load():
    surv = torch.full((64, 5), 0.7)
    lens = torch.full((64,), 5)
    # flat cost up to 16 tokens (latency-bound), then linear (compute-bound)
    cost = StepCostTable([1, 16, 1024], [1.0, 1.0, 64.0])
    light = admit(surv[:2], lens[:2], cost, base_tokens=2, base_yield=2)
    heavy = admit(surv, lens, cost, base_tokens=64, base_yield=64)
    assert light.num_slots.tolist() == [5, 5]
    assert heavy.num_slots.sum().item() < 64  # under load at most a few slots
    assert heavy.expected_tokens / heavy.expected_seconds >= 64 / float(cost.cost(torch.tensor(64.0)))
