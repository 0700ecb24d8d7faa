"""The admission's hold (spec/slot_policy.py `_holds_admission`): after hold_after priced admissions in a row at a
load verified every held slot, the next replan_every - 1 admissions there verify every held slot unpriced, then one
prices again; probes, measures and explorations are never held; other loads' admissions in between do not break a
load's streak. The hold is decided from past admissions only, so drafts whose slots the pricing would drop are
verified in full while held (what the hold costs) and the next priced admission drops them and ends the hold."""

from __future__ import annotations

from chain_policies import chain_policy

from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.scheduler import StepCostTable


def drafts(n: int, conf: float, k: int = 5) -> list[HeldDraft]:
    return [HeldDraft(seq=None, num_tokens=0, tokens=[1] * k, confidence=[conf] * k) for _ in range(n)]


def policy(**fields):
    """Slots nearly free (the step table rises 1e-7 s a token): the pricing verifies every confident slot."""
    settings = {"admit_all_below": 0.0, "replan_every": 8, "hold_after": 3,
                "cost": StepCostTable([1, 4096], [0.01, 0.01 + 4095e-7])}
    return chain_policy([0.9, 0.8, 0.7, 0.6, 0.5], one=0.004, full=0.02, **{**settings, **fields})


def test_the_hold_starts_after_a_streak_and_prices_once_a_plan():
    p = policy()
    good = drafts(4, 0.9)
    priced = []
    for step in range(20):
        before = p.num_admission_holds
        assert p.counts(good, [5] * 4, 4, 4) == [5] * 4, step
        priced.append(p.num_admission_holds == before)
    # three priced, then 7 held and 1 priced, twice over
    assert priced == [True] * 3 + [False] * 7 + [True] + [False] * 7 + [True] + [False]
    assert p.num_admission_holds == 15


def test_a_held_admission_verifies_what_pricing_drops_and_the_next_pricing_ends_the_hold():
    p = policy()
    for _ in range(3):
        p.counts(drafts(4, 0.9), [5] * 4, 4, 4)
    bad = drafts(4, 0.01)  # slots the pricing drops (their survival is near 0)
    fresh = policy()
    want = fresh.counts(bad, [5] * 4, 4, 4)
    assert sum(want) < 20  # the pricing drops them
    held = [p.counts(bad, [5] * 4, 4, 4) for _ in range(7)]
    assert held == [[5] * 4] * 7 and p.num_admission_holds == 7  # held: decided before these drafts were seen
    assert p.counts(bad, [5] * 4, 4, 4) == want  # priced again: the hold's end
    assert p.counts(drafts(4, 0.9), [5] * 4, 4, 4) == [5] * 4 and p.num_admission_holds == 7  # the streak restarts


def test_probes_measures_and_explorations_are_never_held():
    for flag in ("probe", "verify_all", "explore"):
        p = policy()
        for _ in range(3):
            p.counts(drafts(4, 0.9), [5] * 4, 4, 4)
        setattr(p, flag, True)
        got = p.counts(drafts(4, 0.9), [5] * 4, 4, 4)
        assert p.num_admission_holds == 0, flag
        if flag == "probe":
            assert got == [5] * 4 and p.verifying_probe  # the probe's own rule (probe_seqs = 4)


def test_a_loads_streak_survives_other_loads_and_replan_every_one_prices_every_step():
    p = policy()
    for _ in range(3):
        p.counts(drafts(4, 0.9), [5] * 4, 4, 4)  # load bucket of 4 sequences
    p.counts(drafts(1, 0.9), [5], 1, 1)  # another load: priced, its own streak
    assert p.num_admission_holds == 0
    p.counts(drafts(4, 0.9), [5] * 4, 4, 4)
    assert p.num_admission_holds == 1  # back at 4: its streak held
    every = policy(replan_every=1)
    for _ in range(10):
        every.counts(drafts(4, 0.9), [5] * 4, 4, 4)
    assert every.num_admission_holds == 0


def test_the_hold_lasts_the_plans_interval_as_it_grows():
    """With the plan's interval grown to 16 (repeated plans, SlotPolicy.plan_interval), a streak holds 15
    admissions between priced ones instead of replan_every - 1 = 7."""
    p = policy(max_replan_every=16)
    p._replan_interval = 16
    good = drafts(4, 0.9)
    priced = []
    for _ in range(3 + 16 + 1):
        before = p.num_admission_holds
        p.counts(good, [5] * 4, 4, 4)
        priced.append(p.num_admission_holds == before)
    assert priced == [True] * 3 + [False] * 15 + [True] + [False]
