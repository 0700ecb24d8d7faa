"""Paired tokens (spec/realized_rates.py, "Why paired tokens"): a step that verified a chain of L also counts the
tokens every shorter chain would have emitted on it, and the plan prices each chain by those counts on the longest
trusted chain's steps, so chains measured at different moments of a closed batch are compared at one."""

from __future__ import annotations

import tempfile
from itertools import pairwise

import pytest
from chain_policies import chain_policy

from benchmarks.spec_host import VOCAB, make_engine, run_cell
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.spec.realized_rates import RealizedRates, counterfactual


def test_counterfactual_tokens_cut_each_sequence_at_the_shorter_chain():
    # two sequences emitted 1 token (their first draft rejected), one 3, one 6 (a chain of 5 accepted in full)
    assert counterfactual([0, 2, 0, 1, 0, 0, 1], 5) == [4, 6, 8, 9, 10, 11]
    assert counterfactual([0, 0, 0, 0, 3], 3) == [3, 6, 9, 12]
    assert counterfactual([0.0] * 4, 2) == [0, 0, 0]


def phased(paired: bool) -> RealizedRates:
    """Chains 5 and 3 at 4 sequences, plain decoding too. Chain 5 drafted in a batch's hard first steps (two
    sequences accept all five drafts, two reject the second: 16 tokens, 12 of them within a chain of 3), chain 3 in
    its middle (every sequence accepts all three: 16 tokens). Per step chain 5 takes 1.2 ms, chain 3 1.0 ms."""
    r = RealizedRates(warm_steps=0, paired=paired)
    for _ in range(6):
        r.step(4, 0, 0, False, 4, 0.0008)
        r.step(4, 5, 5, True, 16, 0.0012, emitted=[0, 0, 2, 0, 0, 0, 2])
    for _ in range(6):
        r.step(4, 3, 3, True, 16, 0.0010, emitted=[0, 0, 0, 0, 4])
    return r


def test_paired_tokens_compare_chains_on_the_same_steps():
    """On chain 5's steps a chain of 3 would have emitted 12 tokens (12,000 tok/s at its own 1.0 ms a step) where 5
    emitted 16 (13,333): 5 is the faster chain at that moment. Chain 3's own steps (a later, easier moment) read
    16,000 tok/s and, unpaired, put it first; paired, its own steps give only its seconds."""
    own = phased(paired=False)
    assert own.rate(4, 3) == pytest.approx(16 / 0.0010) and own.rate(4, 5) == pytest.approx(16 / 0.0012)
    assert own.separation(4, 5, 3) < 0
    got = phased(paired=True)
    assert got.paired_tokens(4, 5) == pytest.approx([4, 8, 10, 12, 14, 16])
    assert got.paired_tokens(4, 3) == pytest.approx([4, 8, 12, 16]) and got.paired_tokens(4, 4) is None
    assert got.rate(4, 3) == pytest.approx(12 / 0.0010) and got.rate(4, 5) == pytest.approx(16 / 0.0012)
    assert got.separation(4, 5, 3) > 0
    gains = got.gains(4, 5)
    assert gains[5] > gains[3] and gains[3] == pytest.approx((12 / 0.0010) / (4 / 0.0008))
    assert got.chains_at_one_load(4, 5)[5][0] > got.chains_at_one_load(4, 5)[3][0]
    assert got.paired_rows(4) == [(0, pytest.approx(5000)), (3, pytest.approx(12000)), (5, pytest.approx(16 / 0.0012))]


def test_the_longest_chains_steps_price_the_shorter_ones_until_they_go_stale():
    """A chain's paired tokens come from the longest chain trusted at the load: once its measure is stale (max_age)
    or forgotten (a challenge of it, a pause's end), each chain's own tokens price it again."""
    r = phased(paired=True)
    r.forget_chain(4, 5)
    assert r.rate(4, 5) is None and r.rate(4, 3) == pytest.approx(16 / 0.0010)
    r = phased(paired=True)
    r.max_age = 12
    for _ in range(5):  # chain 5 last observed 6 steps ago (its six chain-3 steps since), now 11, then 16
        r.tick()
    assert r.rate(4, 3) == pytest.approx(12 / 0.0010)
    for _ in range(5):
        r.tick()
    assert r.rate(4, 5) is None and r.rate(4, 3) == pytest.approx(16 / 0.0010)


def test_a_step_without_counts_or_not_steady_keeps_no_counterfactual():
    r = RealizedRates(warm_steps=0)
    for _ in range(4):
        r.step(4, 5, 5, True, 16, 0.0012)  # (no counts given: a caller that has none)
        r.step(1, 5, 3, True, 6, 0.0012, emitted=[0, 0, 0, 0, 0, 0, 1])  # (not steady: 5 verified, 3 drafted)
        r.step(2, 3, 3, True, 6, 0.0012, emitted=[0, 0, 0, 0, 0, 0, 1])  # (counts past a chain of 3: not kept)
    assert r.emitted == {} and r.rate(4, 5) == pytest.approx(16 / 0.0012)


def test_the_plan_drafts_the_chain_that_wins_on_the_same_steps():
    """The phase of test_paired_tokens_compare_chains_on_the_same_steps at one sequence, through the plan: chain 5's
    steps in a hard phase (half of them accept everything, half reject the second draft), chain 3's in an easy one.
    Unpaired the plan drafts a shorter chain than 5; paired it keeps 5."""
    def planned(paired: bool) -> int:
        p = chain_policy([0.95] * 5, one=0.001, full=0.003, realized=RealizedRates(warm_steps=0, paired=paired))
        seconds = p.chain_model(1)[1]
        for _ in range(8):
            p.realized.step(1, 0, 0, False, 1, seconds[0])
            p.realized.step(1, 5, 5, True, 6, seconds[5], emitted=[0, 0, 0, 0, 0, 0, 1])
            p.realized.step(1, 5, 5, True, 2, seconds[5], emitted=[0, 0, 1, 0, 0, 0, 0])
            p.realized.step(1, 3, 3, True, 4, seconds[3], emitted=[0, 0, 0, 0, 1])
        return p._choose_chain(1)

    assert planned(paired=False) < 5
    assert planned(paired=True) == 5


def test_an_engine_counts_the_shorter_chains_tokens_on_its_steady_steps():
    """The spec_host stand-in engine (one sequence, an adaptive plan that drafts chains of 5): the pipeline passes
    each steady drafting step's counts of emitted tokens, so the realized rates hold the counterfactual tokens of
    chains 0..5 at load 1: one token a step without drafting, never fewer with a longer chain, chain 5's its own."""
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, VOCAB)
        engine = make_engine(tok, "adaptive", 1, 256)
        p = engine._spec.policy
        run_cell(engine, 1, 128)
    chains = [c for (load, c) in p.realized.emitted if load == 1]
    assert chains, p.realized.rows()
    longest = max(chains)
    cf = p.realized.paired_tokens(1, longest)
    assert len(cf) == longest + 1 and cf[0] == pytest.approx(1.0)
    assert all(a <= b + 1e-9 for a, b in pairwise(cf)) and cf[-1] > cf[0]
    assert cf[-1] == pytest.approx(p.realized.tokens[(1, longest)], rel=0.5)  # (own tokens: a median start)


def test_the_plans_model_takes_paired_tokens_only_where_asked_and_counted():
    """SlotPolicy.paired_model (an A/B knob, off): "longest" / "current" put the counts of the longest trusted chain
    / the chain drafted now in place of the model's tokens (per sequence, times the load; a chain past them the
    model's deeper slots added), once they hold paired_min_steps steps; off, or fewer steps, the model's own."""
    def primed(mode: str, steps: int, chain: int = 5):
        p = chain_policy([0.6] * 5, one=0.001, full=0.003, paired_model=mode,
                         realized=RealizedRates(warm_steps=0))
        p.chain = chain
        for _ in range(steps):  # at 2 sequences: chain 5's steps emit 6 and 3 tokens, chain 3's 3 and 4
            p.realized.step(2, 5, 5, True, 9, 0.002, emitted=[0, 0, 0, 1, 0, 0, 1])
            p.realized.step(2, 3, 3, True, 7, 0.0015, emitted=[0, 0, 0, 1, 1])
        return p

    model = primed("", 10).chain_model(2)[0]
    assert primed("", 10)._paired_tokens(2, model) == model
    assert primed("longest", 4)._paired_tokens(2, model) == model  # (4 steps: fewer than paired_min_steps)
    assert primed("longest", 10)._paired_tokens(2, model) == pytest.approx([2, 4, 6, 7, 8, 9])  # (chain 5's)
    cur = primed("current", 10, chain=3)._paired_tokens(2, model)
    assert cur[:4] == pytest.approx([2, 4, 6, 7])  # (chain 3's steps: one sequence emitted 3, one 4)
    assert cur[5] - cur[3] == pytest.approx(model[5] - model[3])  # past chain 3: the model's deeper slots


def test_a_load_come_back_to_unmeasured_drafts_k_until_a_chain_is_trusted():
    """SlotPolicy.measure_visits: the first plan at a load since plans at another, where no chain's realized rate is
    trusted, drafts chains of k for the steps a measure takes (warm_steps + min_count), then the plan prices the
    chains by that measure; the model alone (here: the deeper slots priced at 5% survival) would draft a chain of 1.
    A load whose measure is trusted plans at once; measure_visits False, or measure_steps 0, plans by the model."""
    def policy(**fields):
        return chain_policy([0.9, 0.05, 0.05, 0.05, 0.05], one=0.001, full=0.0012,
                            realized=RealizedRates(warm_steps=2), **{"measure_steps": 4, **fields})

    p = policy()
    for _ in range(5):  # (the load's steps seen before: no `measure` plans)
        p.step_times.observe("speculative", 4, 0.002, 0.002)
        p.step_times.observe("plain", 4, 0.001, 0.001)
    p._last_plan = (64, 5)  # the last plan was at another load
    chains = [p.plan_drafting(4) for _ in range(5)]
    assert chains == [5] * 5 and p.decisions["visit"] == 1 and p.decisions["remeasure"] == 4
    for _ in range(5):  # (what those steps measured: every sequence accepted every draft)
        p.realized.step(4, 5, 5, True, 24, 0.0015, emitted=[0, 0, 0, 0, 0, 0, 4])
    assert p.realized.rate(4, 5) is not None
    assert p.plan_drafting(4) == 5 and p.decisions.get("visit") == 1  # priced by the measure, not visited again
    for off in (policy(measure_visits=False), policy(measure_steps=0)):
        for _ in range(5):
            off.step_times.observe("speculative", 4, 0.002, 0.002)
            off.step_times.observe("plain", 4, 0.001, 0.001)
        off._last_plan = (64, 5)
        assert off.plan_drafting(4) < 5 and "visit" not in off.decisions
