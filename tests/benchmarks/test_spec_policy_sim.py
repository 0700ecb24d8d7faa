"""benchmarks/spec_policy_sim.py's `--policy FIELD=VALUE` A/B: the field reaches the adaptive policy (a run without
challenges makes none where the default makes some), and a name SlotPolicy lacks or a value that is no literal is
refused naming it."""

from __future__ import annotations

import itertools
import random

import pytest

from benchmarks import spec_policy_sim as sim


def _run(fields: dict | None) -> dict:
    return sim.simulate(sim.MODELS["h200-b4"], "adaptive", 3000, seed=0, host_factor=0.0, max_tokens=128, repeats=3,
                        policy_fields=fields)


def test_policy_fields_reach_the_adaptive_policy():
    assert _run(None)["decisions"].get("challenge", 0) > 0  # (so the A/B below can fail)
    assert _run({"challenge_every": 0})["decisions"].get("challenge", 0) == 0


def test_a_dotted_field_reaches_the_policys_part():
    """`realized.paired=False` (RealizedRates.paired): each chain priced by its own steps' tokens, a different plan
    on the same draws; a part or a field that does not exist is refused naming it."""
    assert _run({"realized.paired": False})["decisions"] != _run(None)["decisions"]
    for name in ("realized.no_such_knob", "no_such_part.paired"):
        with pytest.raises(SystemExit, match=f"--policy {name}: SlotPolicy has no such field"):
            _run({name: 1})


def test_unknown_field_and_bad_value_are_refused():
    with pytest.raises(SystemExit, match="--policy no_such_knob: SlotPolicy has no such field"):
        _run({"no_such_knob": 1})
    with pytest.raises(SystemExit, match="not a Python literal"):
        sim.main(["--model", "h200-b4", "--steps", "10", "--policy", "time_fit=maybe"])
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        sim.main(["--model", "h200-b4", "--steps", "10", "--policy", "time_fit"])


def test_a_batch_phase_lowers_the_first_steps_acceptance_only():
    """`--batch-phase STEPS:FACTOR`: a closed batch's first STEPS steps accept each slot at FACTOR times its rate, so a
    static k's tau falls by about FACTOR's share over those steps, and a bad spec is refused naming the flag."""
    def tau(phase) -> float:
        return sim.simulate(sim.MODELS["h200-b4"], "k5", 3000, seed=0, host_factor=0.0, max_tokens=128, repeats=3,
                            phase=phase)["tau"]

    plain, hard, none = tau(None), tau((20, 0.5)), tau((0, 0.5))
    assert none == plain  # no steps in the phase: the same draws
    assert hard < 0.85 * plain
    with pytest.raises(SystemExit, match="--batch-phase '20'"):
        sim.main(["--model", "h200-b4", "--max-tokens", "64", "--batch-phase", "20"])
    with pytest.raises(SystemExit, match="0 < FACTOR <= 1"):
        sim.main(["--model", "h200-b4", "--max-tokens", "64", "--batch-phase", "20:1.5"])


def test_slow_stretches_slow_the_steps_in_runs_and_a_bad_spec_is_refused():
    """`--stretches STEPS:FACTOR`: the device runs FACTOR times slower in stretches of about STEPS steps, so a static
    k's rate falls to between 1 / FACTOR and 1 of its own (about halfway: slow half the time), with the same tokens
    a step; the stretches come in runs (a switch a step would be no stretch); a bad spec is refused naming the flag."""
    def run(stretches) -> dict:
        return sim.simulate(sim.MODELS["h100-b1"], "k5", 3000, seed=0, host_factor=0.0, max_tokens=512, repeats=3,
                            stretches=stretches)

    fast, slow = run(None), run((30, 2.0))
    assert 0.55 < slow["per_seq_tok_s"] / fast["per_seq_tok_s"] < 0.9
    assert slow["tau"] == pytest.approx(fast["tau"], rel=0.05)
    stretch = sim._Stretches((30, 2.0), random.Random(0))
    flags = [stretch() for _ in range(3000)]
    switches = sum(a != b for a, b in itertools.pairwise(flags))
    assert 60 < switches < 140 and 0.3 < flags.count(2.0) / len(flags) < 0.7  # ~100 switches: runs of ~30 steps
    with pytest.raises(SystemExit, match="--stretches '30'"):
        sim.main(["--model", "h100-b1", "--max-tokens", "64", "--stretches", "30"])
    with pytest.raises(SystemExit, match="FACTOR >= 1"):
        sim.main(["--model", "h100-b1", "--max-tokens", "64", "--stretches", "30:0.5"])


def test_bounded_challenges_leave_out_the_shorter_chains_where_every_draft_is_accepted():
    """One sequence whose drafts are all accepted (h100-b1): with the bound (SlotPolicy.bound_challenges, the default)
    no challenge runs and every drafting step drafts chains of 5; without it shorter chains are challenged."""
    def run(fields) -> dict:
        return sim.simulate(sim.MODELS["h100-b1"], "adaptive", 3000, seed=0, host_factor=0.0, max_tokens=512,
                            repeats=3, policy_fields=fields, stretches=(30, 1.5))

    bounded, unbounded = run(None), run({"bound_challenges": False})
    assert bounded["decisions"].get("challenge", 0) == 0 and bounded["mean_chain"] == 5.0
    assert unbounded["decisions"].get("challenge", 0) > 0


def test_plain_factor_and_slope_of_the_v2_lite_models():
    """h100v8-*: a plain step at plain_factor of the table (off's rate follows it); a steep acceptance slope keeps
    the mean acceptance near its design (~0.85: k1's tau); `recent_drafts=N` makes the chain
    model's sampled reach (spec/recent_drafts.py) and changes the adaptive plan on the same draws."""
    m = sim.MODELS["h100v8-b1"]
    off = sim.simulate(m, "off", 400, seed=0, host_factor=0.0)
    step = m.table.at(1) * m.plain_factor + m.h0 + m.h_tok
    assert off["per_seq_tok_s"] == pytest.approx(1.0 / step, rel=0.03)
    k1 = sim.simulate(m, "k1", 3000, seed=0, host_factor=0.0)
    assert 1.8 < k1["tau"] < 1.9
    base = sim.simulate(m, "adaptive", 3000, seed=0, host_factor=0.0, max_tokens=256, repeats=2)
    sampled = sim.simulate(m, "adaptive", 3000, seed=0, host_factor=0.0, max_tokens=256, repeats=2,
                           policy_fields={"recent_drafts": 32})
    assert sampled["decisions"] != base["decisions"]
