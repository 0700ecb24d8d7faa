"""The adaptive plan's measured side (spec/realized_rates.py) and its cadence (SlotPolicy.replan_every): realized
tokens per second of steady steps decide the chain where measured, the model proposes where not, and a plan holds
for replan_every steps at its load."""

from __future__ import annotations

import pytest
from chain_policies import chain_policy

from deepinfer.spec.realized_rates import RealizedRates
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy


def policy_with(accept: list[float], one: float, full: float, replan_every: int = 1, **fields) -> SlotPolicy:
    """chain_policy (tests/spec/chain_policies.py) with realized rates counted from their first step."""
    return chain_policy(accept, one, full, replan_every=replan_every, realized=RealizedRates(warm_steps=0), **fields)


def test_realized_rates_start_at_the_median_and_need_min_count_steps():
    r = RealizedRates(warm_steps=0)
    r.observe(4, 0, 4, 0.001)
    r.observe(4, 0, 4, 0.100)  # a stall (a kernel compiled): the median of three ignores it
    assert r.rate(4, 0) is None  # two steps are not a steady state
    r.observe(4, 0, 4, 0.002)
    assert r.rate(4, 0) == pytest.approx(4 / 0.002)
    assert r.rate(3, 0) == pytest.approx(4 / 0.002)  # the same bucket (4)
    assert r.rate(5, 0) is None and r.rate(4, 1) is None


def test_a_chains_first_steps_at_a_load_are_not_counted():
    r = RealizedRates(warm_steps=2)
    r.observe(4, 5, 20, 0.050)  # first replays: slow
    r.observe(4, 5, 20, 0.040)
    for _ in range(3):
        r.observe(4, 5, 20, 0.005)
    assert r.rate(4, 5) == pytest.approx(4000) and r.counts[(4, 5)] == 3
    r.forget_drafting(4)
    r.observe(4, 5, 20, 0.005)
    assert (4, 5) not in r.counts  # forgotten: warm again


def test_a_later_stall_pulls_the_average_at_most_spread_times():
    r = RealizedRates(warm_steps=0)
    for _ in range(3):
        r.observe(1, 2, 3, 0.001)
    r.observe(1, 2, 3, 1.0)  # 1000x the steady step: clamped to 2x before it is averaged
    assert r.rate(1, 2) == pytest.approx(3 / (0.8 * 0.001 + 0.2 * 0.002))


def test_step_observes_steady_steps_only():
    r = RealizedRates(warm_steps=0)
    r.step(8, 0, 3, False, 8, 0.01)  # drafting starts: drafted now, nothing verified of it yet
    r.step(8, 3, 1, True, 30, 0.01)  # the chain changed: its cost and its yield are of two plans
    r.step(8, 1, -1, True, 20, 0.01)  # a probe's few
    r.step(8, 0, 0, True, 20, 0.01)  # verified but drafted nothing (the last step before a pause)
    assert r.counts == {} and r.now == 4
    for _ in range(3):
        r.step(8, 3, 3, True, 30, 0.01)
        r.step(8, 0, 0, False, 8, 0.004)
    assert r.rate(8, 3) == pytest.approx(3000) and r.rate(8, 0) == pytest.approx(2000)
    assert r.gains(8, 5) == {3: pytest.approx(1.5)}



def _state(r: RealizedRates) -> tuple:
    return (r.now, r.tokens, r.seconds, r.counts, r.last, r._first, r._warm, r._loads, r._step_rate, r._step_rate_sq,
            r.emitted, r._longest, r.trace)


def test_a_steady_step_by_the_short_path_updates_as_step_does():
    """RealizedRates.steady_step (the adaptive mode's settled steps) against step with the counts of sequences by
    tokens emitted: the same floats in every table, from a (load, chain)'s warm-up and first steps (the long path)
    through its moving averages (the short one), with stalls, one and many sequences, a length past the chain (no
    counts); with a plan trace kept (benchmarks.speculative --plan-trace), the same entries."""
    import random

    rng = random.Random(7)
    short, long = RealizedRates(trace=[]), RealizedRates(trace=[])
    for i in range(400):
        n = rng.choice([1, 1, 4, 16])
        chain = rng.choice([3, 5]) if i % 50 else 2
        lens = bytes(rng.randint(1, chain + 1) for _ in range(n))
        if i % 97 == 0:
            lens = bytes([chain + 2]) + lens[1:]  # (a length past the chain: no counts, as the engine gives none)
        tokens = sum(lens)
        seconds = 0.001 * n * (50 if i % 31 == 0 else rng.uniform(0.8, 1.2))  # (some stalls: the spread's clamp)
        counts = [lens.count(e) for e in range(chain + 2)] if max(lens) <= chain + 1 else None
        short.steady_step(n, chain, tokens, seconds, lens)
        long.step(n, chain, chain, True, tokens, seconds, emitted=counts)
        assert _state(short) == _state(long), i
    assert sum(long.counts.values()) > 300  # (most of them past their first steps: the short path ran)
    assert len(long.trace) == 400  # (every step traced: none ended)

def host_bound_step(num_seqs: int, tokens_per_seq: float, fixed: float, per_seq: float) -> tuple[float, float]:
    """(tokens, seconds) of a step whose time is a fixed host part plus a part per sequence (the H200's shape)."""
    return num_seqs * tokens_per_seq, fixed + per_seq * num_seqs


def test_gains_compare_chains_and_plain_decoding_at_one_load():
    """A closed batch: plain decoding measured where the batch is whole (64 sequences), a chain of 5 there too (1.3x
    plain decoding) and then, for many steps, in the run's tail (34 sequences, near their max_tokens: drafts clipped
    to 2.5 tokens a step). A step at 34 sequences emits fewer tokens per second than one at 64 whatever it runs:
    mixed in one bucket, the tail's steps read as a loss (below the 10% pause margin); compared at one load, the
    chain's gain is 1.3 at 48 sequences (the nearest load of the bucket measured both ways)."""
    r = RealizedRates(warm_steps=0)
    plain = host_bound_step(64, 1.0, 0.45e-3, 0.015e-3)
    chain5 = host_bound_step(64, 3.0, 0.45e-3 * 3.0 / 1.3, 0.015e-3 * 3.0 / 1.3)
    for _ in range(4):
        r.observe(64, 0, *plain)
        r.observe(64, 5, *chain5)
    for _ in range(20):
        r.observe(34, 5, *host_bound_step(34, 2.5, 0.45e-3 * 3.0 / 1.3, 0.015e-3 * 3.0 / 1.3))
    assert r.gains(48, 5) == {5: pytest.approx(1.3)}
    assert r.gains(34, 5) == {5: pytest.approx(1.3)}  # plain decoding is not measured at 34: the load measured both
    mixed = (r.tokens[(34, 5)] / r.seconds[(34, 5)]) / (r.tokens[(64, 0)] / r.seconds[(64, 0)])
    assert mixed < 1 / 1.1  # what one bucket's averages compared (the tail's chain against the whole batch's plain)
    assert r.rate(34, 5) == pytest.approx(r.tokens[(34, 5)] / r.seconds[(34, 5)])  # the load itself first
    assert r.rate(48, 0) == pytest.approx(plain[0] / plain[1])  # else the bucket's nearest measured load


def test_a_chain_measured_only_where_plain_decoding_is_not_has_no_gain():
    r = RealizedRates(warm_steps=0)
    for _ in range(3):
        r.observe(64, 0, 64, 0.0014)
        r.observe(40, 3, 100, 0.0014)
        r.observe(20, 3, 50, 0.001)  # another bucket
    assert r.gains(40, 5) == {} and r.gains(64, 5) == {}
    for _ in range(3):
        r.observe(40, 0, 40, 0.001)
    assert r.gains(64, 5) == {3: pytest.approx((100 / 0.0014) / (40 / 0.001))}
    r.forget_drafting(33)  # the bucket's drafting measures, at every load of it
    assert r.gains(40, 5) == {} and r.rate(40, 3) is None and r.rate(20, 3) is not None
    assert r.rate(64, 0) is not None and r.rate(40, 0) is not None


def test_the_plan_drafts_where_only_the_tail_measured_drafting_below_plain():
    """The plan at 48 sequences: plain decoding measured at the whole batch (64), a chain of 5 at the same load
    running 1.3x, and the tail's chain steps (34 sequences, clipped drafts) slower per second than the whole batch's
    plain steps. The policy keeps drafting (by one bucket's averages it paused: 0.85x plain decoding)."""
    policy = policy_with([1.0] * 5, one=0.001, full=0.002)
    r = policy.realized
    for _ in range(4):
        r.observe(64, 0, *host_bound_step(64, 1.0, 0.45e-3, 0.015e-3))
        r.observe(64, 5, *host_bound_step(64, 3.0, 0.45e-3 * 3.0 / 1.3, 0.015e-3 * 3.0 / 1.3))
    for _ in range(20):
        r.observe(34, 5, *host_bound_step(34, 2.5, 0.45e-3 * 3.0 / 1.3, 0.015e-3 * 3.0 / 1.3))
    assert policy.plan_drafting(48) == 5 and policy.paused == 0


def test_a_measure_goes_stale_after_max_age_steps():
    r = RealizedRates(max_age=10, warm_steps=0)
    for _ in range(3):
        r.observe(2, 0, 2, 0.001)
        r.observe(2, 4, 6, 0.002)
    assert r.gains(2, 5) == {4: pytest.approx(1.5)}
    for _ in range(11):
        r.tick()
    assert r.rate(2, 4) is None and r.gains(2, 5) == {}


def test_measured_gains_overrule_the_model_both_ways():
    """The model drafts (every slot accepted, drafting cheap) where the measure says plain decoding was faster:
    the plan pauses; and the model pauses (drafting dear) where a measured chain of 5 ran 1.5x: it drafts 5."""
    drafts = policy_with([1.0] * 5, one=0.001, full=0.002)
    assert drafts.chain_rates(4)[5] > drafts.chain_rates(4)[0]  # the model's view
    for _ in range(3):
        drafts.realized.observe(4, 0, 4, 0.001)
        drafts.realized.observe(4, 5, 20, 0.008)  # 2,500 tok/s against plain's 4,000
    assert drafts.plan_drafting(4) == 0 and drafts.paused > 0 and drafts.decisions["overruled"] == 1

    pauses = policy_with([0.1] * 5, one=0.2, full=0.2)
    assert pauses.plan_drafting(4) == 0  # the model alone
    pauses = policy_with([0.1] * 5, one=0.2, full=0.2)
    for _ in range(3):
        pauses.realized.observe(4, 0, 4, 0.001)
        pauses.realized.observe(4, 5, 12, 0.002)  # 6,000 tok/s: 1.5x
    assert pauses.plan_drafting(4) == 5 and pauses.decisions == {"overruled": 1, "chain5": 1}


def test_a_pause_needs_drafting_to_lose_by_the_margin():
    """Chains measured against plain decoding at the load follow measured_pause_margin (0.03): at 0.98x plain they
    keep drafting (the best of them, ties: shorter), at 0.95x the load pauses (on this CPU at 64 sequences the plan
    kept chains of 1 at a realized 0.92x under the model's margin and ran 0.87x of off; 0.97x with this rule); with
    the model's margin for them too (0.1), 0.95x keeps drafting and 0.85x pauses; with no margin, 0.99x pauses. The
    model alone follows pause_margin."""
    def measured(gain: float, margin: float, measured_margin: float = 0.03) -> int:
        p = policy_with([1.0] * 5, one=0.001, full=0.002, pause_margin=margin, measured_pause_margin=measured_margin)
        for _ in range(3):
            p.realized.observe(4, 0, 4, 0.001)  # plain: 4,000 tok/s
            for chain in range(1, 6):
                p.realized.observe(4, chain, 4 * gain * (1 if chain != 2 else 1.01), 0.001)
        return p.plan_drafting(4)

    assert measured(0.98, 0.1) == 2  # the best measured chain, within the measured margin
    assert measured(0.95, 0.1) == 0
    assert measured(0.95, 0.1, measured_margin=0.1) == 2
    assert measured(0.85, 0.1, measured_margin=0.1) == 0
    assert measured(0.99, 0.0, measured_margin=0.0) == 0
    assert measured(1.05, 0.0, measured_margin=0.0) == 2

    def model(margin: float) -> SlotPolicy:  # a verified token costs 1 ms as a plain step's does: drafting loses a bit
        return policy_with([1.0] * 5, one=0.001, full=0.002, pause_margin=margin,
                           cost=StepCostTable([1, 4096], [0.001, 4.096]))

    rates = model(0.0).chain_rates(4)
    assert 1 / 1.1 < max(rates[1:]) / rates[0] < 1  # (what the two plans below decide on)
    assert model(0.1).plan_drafting(4) > 0
    lost = model(0.0)
    assert lost.plan_drafting(4) == 0 and lost.paused > 0


def test_unmeasured_chains_are_priced_by_the_models_error_at_the_nearest_measure():
    """Chain 5 measured at 0.9x plain where the model said more: every unmeasured chain's modelled gain is scaled by
    that error. With every slot accepted (longer is better by the model's shape) nothing else beats plain decoding
    either: a pause. Where the fifth slot is rarely accepted and its link is dear, the model's chain of 4 beats its
    chain of 5 by more than that error: the plan tries 4."""
    flat = policy_with([1.0] * 5, one=0.001, full=0.0012)
    for _ in range(3):
        flat.realized.observe(4, 0, 4, 0.001)
        flat.realized.observe(4, 5, 18, 0.005)  # 3,600 tok/s: 0.9x
    assert flat.plan_drafting(4) == 0

    shaped = policy_with([0.95, 0.95, 0.95, 0.95, 0.02], one=0.001, full=0.03)
    rates = shaped.chain_rates(4)
    assert rates[4] / rates[5] > 1 / 0.9 and rates[5] > rates[0]
    for _ in range(3):
        shaped.realized.observe(4, 0, 4, 0.001)
        shaped.realized.observe(4, 5, 18, 0.005)
    assert shaped.plan_drafting(4) == 4 and "overruled" not in shaped.decisions  # the model's own choice


def test_chains_measured_against_each_other_order_the_plan_without_a_plain_measure():
    """No plain step at 4 sequences (the load never paused), chains of 3 and 5 measured there with 3 faster (the
    H100's 8,946 against 6,524 tok/s, 2026-12-05) where the model (every slot accepted, links cheap) prefers 5: the
    plan leaves 5 for 4 (unmeasured, the model's gain scaled by its error at 3: the model's shape proposes it);
    with 4 measured slower too, it drafts 3. One chain measured alone, or two at different loads, leave the
    model's choice."""
    def policy(observed) -> SlotPolicy:
        p = policy_with([1.0] * 5, one=0.001, full=0.0012)
        for _ in range(4):
            for load, chain, tokens in observed:
                p.realized.observe(load, chain, tokens, 0.001)
        return p

    assert policy([]).plan_drafting(4) == 5  # the model alone
    both = policy([(4, 3, 8.946), (4, 5, 6.524), (4, 5, 6.524)])
    assert both.realized.gains(4, 5) == {} and set(both.realized.chains_at_one_load(4, 5)) == {3, 5}
    assert both.plan_drafting(4) == 4 and both.decisions.get("overruled") == 1
    three = policy([(4, 3, 8.946), (4, 4, 7.5), (4, 5, 6.524), (4, 5, 6.524)])
    assert three.plan_drafting(4) == 3
    assert policy([(4, 5, 6.524)]).plan_drafting(4) == 5
    apart = policy([(4, 3, 8.946), (5, 5, 6.524)])
    assert apart.realized.chains_at_one_load(4, 5) == {} and apart.plan_drafting(4) == 5


def test_a_plan_holds_for_replan_every_steps_at_its_load():
    policy = policy_with([1.0] * 5, one=0.02, full=0.04, replan_every=4)
    assert policy.plan_drafting(4) == 5
    policy.mean_confidence = [0.05] * 5  # the drafts' confidence collapses: the model would pause now
    assert [policy.plan_drafting(4) for _ in range(3)] == [5, 5, 5]  # the plan holds (steps 2-4)
    assert policy.plan_drafting(4) == 0 and policy.paused > 0  # step 5 plans again: a pause

    moved = policy_with([1.0] * 5, one=0.001, full=0.002, replan_every=4)
    assert moved.plan_drafting(4) == 5
    for _ in range(3):
        moved.realized.observe(16, 0, 16, 0.001)
        moved.realized.observe(16, 5, 40, 0.005)
    assert moved.plan_drafting(16) == 0  # another load: planned at once

    fresh = policy_with([1.0] * 5, one=0.001, full=0.002, replan_every=4)
    assert fresh.plan_drafting(4) == 5
    for _ in range(2):
        fresh.realized.observe(4, 0, 4, 0.001)
        fresh.realized.observe(4, 5, 10, 0.005)
    assert fresh.plan_drafting(4) == 5  # held: chain 5 not measured yet (2 steps)
    fresh.realized.observe(4, 0, 4, 0.001)
    fresh.realized.observe(4, 5, 10, 0.005)
    assert fresh.plan_drafting(4) == 0  # its first measure ends the hold: planned again, a pause


def test_a_repeated_plan_doubles_the_interval_to_the_next_and_a_change_starts_it_over():
    """replan_every 4, max_replan_every 16: plans of the same chain at one load come 4, 8, 16, 16 steps apart; a
    plan at another load, or of another chain than the last at its load, starts over at 4. (The admission's hold
    lasts the interval too: tests/spec/test_spec_admission_hold.py.)"""
    p = policy_with([1.0] * 5, one=0.001, full=0.002, replan_every=4, max_replan_every=16)
    intervals = []
    for _ in range(60):
        p.plan_drafting(4)
        intervals.append(p.plan_interval())
    assert intervals[0] == 4 and intervals[4] == 8 and intervals[12] == 16 and intervals[59] == 16
    assert p.decisions["chain5"] == 60
    p.plan_drafting(8)  # another load: planned at once, the interval starts over
    assert p.plan_interval() == 4
    for _ in range(4):
        p.plan_drafting(8)
    assert p.plan_interval() == 8  # its plan repeated
    p._last_plan, p._plan_age = (8, 3), p.max_replan_every + 1  # as if the last plan there had drafted 3
    p.plan_drafting(8)
    assert p.plan_interval() == 4


def test_step_cost_table_lookups_are_remembered_until_the_seconds_are_replaced():
    table = StepCostTable([1, 8], [0.001, 0.008])
    assert table.at(4) == pytest.approx(0.004) and table.at(4.0) == pytest.approx(0.004)
    table.seconds = [0.002, 0.016]
    assert table.at(4) == pytest.approx(0.008)


def test_a_pause_ends_by_measuring_drafting_afresh():
    """A pause decided on a measure (chain 5 below plain decoding) ends with a probe; its load's drafting measures
    are forgotten, and the chain that measured best before drafts for the steps a fresh measure takes (even where
    the model alone would pause), then the plan compares the fresh measures. So neither a measure taken once (in a
    warm-up) nor a model that prices drafting too dear keeps a load paused for good."""
    policy = policy_with([0.1] * 5, one=0.2, full=0.2)  # the model alone pauses
    policy.realized = RealizedRates(warm_steps=2)
    r = policy.realized
    for _ in range(5):
        r.observe(4, 0, 4, 0.001)
        r.observe(4, 3, 10, 0.004)  # chain 3: 2,500 tok/s
        r.observe(4, 5, 10, 0.005)  # chain 5: 2,000 tok/s
        r.observe(16, 5, 10, 0.005)
    assert policy.plan_drafting(4) == 0 and policy.paused == policy.min_probe_every - 1
    for _ in range(policy.min_probe_every - 1):
        policy.plan_drafting(4)
    assert policy.probe and policy.chain == 5  # the pause's end: a probe
    assert r.rate(4, 5) is None and r.rate(4, 3) is None and r.rate(4, 0) is not None
    assert r.rate(16, 5) is not None  # another load's measures stay
    policy.probe = False  # (its verification, counts)
    steps = r.warm_steps + r.min_count + 1
    assert [policy.plan_drafting(4) for _ in range(steps)] == [3] * steps  # chain 3 measured best before
    assert policy.decisions["remeasure"] == steps
    for _ in range(5):  # measured again: now chain 3 runs 2x plain decoding
        r.observe(4, 3, 16, 0.004)
    # drafting: chain 5 is no longer measured, and the model's shape (a flat drafting cost: longer is better)
    # scaled by its error at chain 3 puts it above chain 3's 2x
    assert policy.plan_drafting(4) == 5 and policy.decisions["overruled"] == 1


def test_the_admission_charges_the_steps_measured_fixed_seconds():
    """Drafts of middling survival where a verified token costs 1% of the table's step: priced by the table alone
    the deeper slots do not pay; with the step's measured excess (here 10x the table's step, a host-bound device)
    every slot does, as on the H200 where a step at 4 sequences ran ~2.5 ms against the table's 0.3."""
    from deepinfer.spec.draft_slots import HeldDraft
    from deepinfer.spec.step_times import SPECULATIVE

    def policy() -> SlotPolicy:
        p = policy_with([0.5] * 5, one=1e-6, full=1e-6)
        p.cost = StepCostTable([1, 4096], [0.001, 0.001 + 4095 * 1e-5])
        p.mean_confidence, p.probe = [0.9] * 5, False
        return p

    held = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * 5, confidence=[0.9] * 5) for _ in range(4)]  # 0.5 each
    table_only = policy()
    assert sum(table_only.counts(held, [5] * 4, 4, 4)) < 20
    measured = policy()
    for _ in range(3):
        measured.step_times.observe(SPECULATIVE, 4, 0.010 + measured.cost.at(24), measured.cost.at(24))
    assert measured._step_fixed_seconds(4) == pytest.approx(0.010, rel=1e-3)
    assert measured.counts(held, [5] * 4, 4, 4) == [5] * 4


def test_a_pause_the_model_decides_within_its_error_is_a_short_check_of_plain_decoding():
    """No gain measured against plain decoding at a load and the model's best chain at ~0.7x plain (within its
    error, model_error 2): the pause is a check, long enough to measure plain decoding there, the backoff untouched;
    it ends re-measuring drafting, and the plan then follows the measures (here a chain of 5 at 1.5x plain). The
    H200's case (2026-12-05, session 22): modelled 0.86x / 0.68x at 64 / 256 sequences, realized 1.46x / 1.27x."""
    policy = policy_with([0.3] * 5, one=0.04, full=0.04)
    r = policy.realized
    assert 0.5 < max(x / policy.chain_rates(8)[0] for x in policy.chain_rates(8)[1:]) < 1.0
    assert policy.plan_drafting(8) == 0 and policy.decisions == {"pause_check": 1}
    check = r.warm_steps + r.min_count + 2
    assert policy.paused == check - 1 and policy.next_pause(8) == policy.min_probe_every  # no backoff
    for _ in range(check - 1):  # the check's plain steps, measured
        r.observe(8, 0, 8, 0.004)
        r.observe(8, 5, 24, 0.008)  # (a chain of 5 measured before, 3,000 tok/s: 1.5x plain's 2,000)
        policy.plan_drafting(8)
    assert policy.probe and policy.chain == 5  # the check's end: a probe, then the re-measure
    policy.probe = False
    steps = r.warm_steps + r.min_count + 1
    assert [policy.plan_drafting(8) for _ in range(steps)] == [5] * steps
    assert r.rate(8, 5) is None  # forgotten at the check's end: measured afresh
    for _ in range(3):
        r.observe(8, 5, 24, 0.008)
    assert r.gains(8, 5) == {5: pytest.approx(1.5)}
    assert policy.plan_drafting(8) == 5 and policy.decisions["pause_check"] == 1


def test_a_pause_is_not_a_check_past_the_models_error_or_its_checks_or_a_measure():
    """A full pause (the load's backoff) where the model's best chain is below 1 / model_error of plain decoding,
    where a gain against plain decoding is measured, after max_checks checks at the load, and with model_error 1."""
    clear = policy_with([0.3] * 5, one=0.2, full=0.2)  # drafting 5x a step: ~0.24x plain
    assert clear.plan_drafting(8) == 0 and clear.paused == clear.min_probe_every - 1 and not clear._checked
    measured = policy_with([0.3] * 5, one=0.04, full=0.04)
    for _ in range(3):
        measured.realized.observe(8, 0, 8, 0.004)
        measured.realized.observe(8, 5, 8, 0.008)  # measured: 0.5x plain
    assert measured.plan_drafting(8) == 0 and measured.paused == measured.min_probe_every - 1
    checks = policy_with([0.3] * 5, one=0.04, full=0.04, max_checks=2)
    lengths = []
    for _ in range(3):
        checks.paused = 0
        checks._remeasure_left = 0
        checks.plan_drafting(8)
        lengths.append(checks.paused)
    check = checks.realized.warm_steps + checks.realized.min_count + 2
    assert lengths == [check - 1, check - 1, checks.min_probe_every - 1]
    off = policy_with([0.3] * 5, one=0.04, full=0.04, model_error=1.0)
    assert off.plan_drafting(8) == 0 and off.paused == off.min_probe_every - 1


def test_a_measure_overrules_the_models_order_only_beyond_its_noise():
    """The model's best chain is 5 (every slot accepted, links cheap). Chains 3 and 5 measured at one sequence, 3's
    realized rate above 5's: where 5's steps vary with their acceptance (1 to 6 tokens, as a chain of 5's do) over 6
    steps, the two measures are within 1.5 standard errors and the model's order stands ("within_noise"): 5, which
    the measured step times agree with (1.45 ms for 6 tokens at full acceptance, 4,138 tok/s); where both measures
    are steady (5 at 3,554 tok/s, no spread), the measures decide. RealizedRates.separation is the difference over
    the combined standard error."""
    def policy(tokens5: list[int], seconds5: float) -> SlotPolicy:
        p = policy_with([1.0] * 5, one=0.001, full=0.0012)
        for _ in range(20):
            p.realized.observe(1, 3, 4, 0.001)  # 4,000 tok/s
        for t in tokens5:
            p.realized.observe(1, 5, t, seconds5)
        return p

    noisy = policy([6, 1, 6, 2, 6, 6], 0.00145)  # each step 690 to 4,138 tok/s
    assert noisy.realized.rate(1, 5) < 4000
    z = noisy.realized.separation(1, 3, 5)
    assert z is not None and 0 < z < noisy.measured_z
    assert noisy.plan_drafting(1) == 5 and noisy.decisions.get("within_noise") == 1

    steady = policy([6] * 6, 0.0017)
    steady.realized.tokens[(1, 5)], steady.realized.seconds[(1, 5)] = 6.0, 6.0 / 3554
    assert steady.realized.separation(1, 3, 5) == float("inf")
    # the measure decides: the plan leaves 5 for 3. (Before the time fit, for 4, unmeasured, the model's gain scaled
    # by its error at 3; with it, 4 is priced by the measured step times, whose slope from 3 to 5 is 0.34 ms a link
    # for one more token a step: below 3's rate, spec/chain_plan.py `_fitted_rates`.)
    assert steady.plan_drafting(1) == 3 and "within_noise" not in steady.decisions
    assert steady.decisions["time_fit"] == 1
    # the fitted line through 3 and 5 puts a chain of 1 at 0.31 ms (6,400 tok/s); no chain's step is shorter than a
    # plain one's (the model's 40 ms plain step on the measured scale at chain 3: ~0.97 ms)
    fitted = steady._fitted_rates(1)
    assert fitted[1] < fitted[3] and fitted[1] == pytest.approx(2 / 0.000975, rel=0.01)
    assert noisy.realized.separation(1, 3, 4) is None  # 4 not measured


def test_two_measured_chains_step_times_propose_a_shorter_chain_the_model_prices_too_low():
    """The drafting table prices a link at a quarter of what it costs (the H200's one-sync k5 ran 0.31 ms over k3 at
    4 sequences where the table said 0.15; here 4x), so a chain of 3 truly runs fastest: chains 4 and 5 measured at
    4 sequences, no plain step. Scaled by
    its error at chain 4 the model keeps 3 below 4; fitted to the two measured step times, 3 comes first, and the
    plan drafts it."""
    p = policy_with([0.8] * 5, one=0.0004, full=0.0006, step=0.0005)
    tokens, modelled = p.chain_model(4)
    link = modelled[5] - modelled[4]

    def true_seconds(chain: int) -> float:  # every link past the first at 4x its modelled cost
        return modelled[chain] + 3 * max(chain - 1, 0) * link

    for chain in (4, 5):
        for _ in range(4):
            p.realized.observe(4, chain, tokens[chain], true_seconds(chain))
    true_rates = [tokens[c] / true_seconds(c) for c in range(6)]
    assert max(range(1, 6), key=lambda c: true_rates[c]) < 4  # truly a shorter chain runs faster
    scaled = [r * (tokens[4] / true_seconds(4)) / p.chain_rates(4)[4] for r in p.chain_rates(4)]
    assert scaled[3] < scaled[4]  # the scale-only fill: 3 below 4
    fitted = p._fitted_rates(4)
    assert fitted is not None and fitted[3] > fitted[4] > fitted[5]
    off = policy_with([0.8] * 5, one=0.0004, full=0.0006, step=0.0005, time_fit=False)
    off.realized = p.realized
    assert off._fitted_rates(4) is None and off.plan_drafting(4) != 3  # (the A/B knob: the scale-only fill)
    assert p.plan_drafting(4) == 3 and p.decisions["time_fit"] == 1
    # one drafting chain measured: no fit (the scale-only fill as before)
    single = policy_with([0.85] * 5, one=0.0004, full=0.0006)
    for _ in range(4):
        single.realized.observe(4, 5, tokens[5], true_seconds(5))
    assert single._fitted_rates(4) is None
    # measured times that fall as the chain grows (noise): no line through them either
    falling = policy_with([0.85] * 5, one=0.0004, full=0.0006)
    for _ in range(4):
        falling.realized.observe(4, 4, tokens[4], true_seconds(5))
        falling.realized.observe(4, 5, tokens[5], true_seconds(4))
    assert falling._fitted_rates(4) is None


def test_a_pause_the_model_alone_decides_is_vetoed_by_a_chain_realized_well_above_its_plain_rate():
    """Links so dear that the model prices every chain below plain decoding (a pause), no plain step measured at 4
    sequences, chain 5 realized there: at 1.8x the model's plain rate the plan drafts 5 ("pause_vetoed"); at 1.05x
    (inside pause_margin) it pauses as before; with plain decoding measured there, the measures decide."""
    def policy(ratio: float, plain_measured: bool = False) -> SlotPolicy:
        p = policy_with([0.5] * 5, one=0.08, full=0.4, pause_margin=0.1)
        plain = p.chain_rates(4)[0]
        assert max(p.chain_rates(4)[1:]) < plain / 1.1  # the model: a pause
        for _ in range(3):
            p.realized.observe(4, 5, 24, 24 / (ratio * plain))
            if plain_measured:
                p.realized.observe(4, 0, 4, 4 / plain)
        return p

    fast = policy(1.8)
    assert fast.plan_drafting(4) == 5 and fast.decisions.get("pause_vetoed") == 1 and fast.paused == 0
    close = policy(1.05)
    assert close.plan_drafting(4) == 0 and "pause_vetoed" not in close.decisions
    measured = policy(1.8, plain_measured=True)
    # gains() decided: drafting (chain 1 here: the model's shape scaled by its error at the measured 5)
    assert measured.plan_drafting(4) > 0 and "pause_vetoed" not in measured.decisions and measured._plan_measured


def test_with_fit_orders_the_fit_orders_chains_a_phase_low_measure_does_not():
    """Chains 3 and 5 measured at one sequence, their step times as the model prices them, but chain 5's tokens
    measured in a batch's hard first steps (3.7 a step where its calibrated survival yields ~5.3) and chain 3's in its
    middle (its calibrated 3.7): the realized rates put 3 above 5 (by a margin no noise hides: every step alike), so
    the plan drafts a shorter chain (4, which the fit proposes between the two measures). With fit_orders the fit orders them (measured step times, calibrated tokens): 5, as truly. The
    most-measured chain's realized gain over plain decoding scales them, so the gains stay measured ones."""
    def primed(**fields) -> SlotPolicy:
        p = policy_with([0.95] * 5, one=0.001, full=0.003, **fields)
        tokens, seconds = p.chain_model(1)
        for _ in range(6):
            p.realized.observe(1, 0, 1, seconds[0])
            p.realized.observe(1, 3, tokens[3], seconds[3])
            p.realized.observe(1, 5, tokens[3], seconds[5])  # chain 5's tokens as low as chain 3's: a hard phase
        p.realized.observe(1, 5, tokens[3], seconds[5])  # (chain 5 the most measured)
        return p

    measured = primed()
    assert measured.realized.rate(1, 3) > measured.realized.rate(1, 5)
    assert measured._choose_chain(1) < 5 and measured._plan_gains[3] > measured._plan_gains[5]
    ordered = primed(fit_orders=True)
    assert ordered._choose_chain(1) == 5 and ordered.decisions["time_fit"] == 1
    gains = ordered._plan_gains
    assert gains[5] == pytest.approx(ordered.realized.gains(1, 5)[5])  # the anchor keeps its realized gain
    assert gains[5] > gains[4] > gains[3]
