"""Observations that wait (spec/settled_steps.py): while the adaptive policy holds its next step (`will_hold`), the
pipeline keeps the policy's observations in order (`SpecStepPipeline._policy_log`) and runs them at the first step
that decides anything. Checked on the spec_host stand-in engine (benchmarks/spec_host.py, whose decisions do not
depend on wall time: tables priced, realized rates not deciding): they do wait (many at once), no plan nor priced
admission runs while any waits, and the engine decides, calibrates and counts exactly as one whose observations
never wait (max_waiting_observations 0)."""

from __future__ import annotations

import tempfile

import pytest

from benchmarks.spec_host import VOCAB, make_engine, run_cell
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer


@pytest.fixture(scope="module")
def tok_dir():
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, VOCAB)
        yield tok


def watched(tok: str, mode: str, conc: int, max_waiting: int):
    """An engine whose plans and priced admissions record how many observations waited when they ran (a test's
    wrapper of two of the policy's methods), and whose folds record how many they ran."""
    engine = make_engine(tok, mode, conc, 256)
    spec, p = engine._spec, engine._spec.policy
    p.max_waiting_observations = max_waiting
    seen = {"plans": [], "priced": [], "folds": []}
    choose, step_fixed, fold = p._choose_chain, p._step_fixed_seconds, spec._fold_policy_log

    def choose_chain(num_seqs):
        seen["plans"].append(spec._policy_waiting)
        return choose(num_seqs)

    def fixed_seconds(num_seqs):  # (every priced admission reads the step's fixed seconds first)
        seen["priced"].append(spec._policy_waiting)
        return step_fixed(num_seqs)

    def folded(n):
        seen["folds"].append(n)
        return fold(n)

    p._choose_chain, p._step_fixed_seconds, spec._fold_policy_log = choose_chain, fixed_seconds, folded
    return engine, seen


def state(engine) -> tuple:
    """What the policy's decisions read and made: decisions, the calibration table, realized and step-time counts,
    the plan's age and interval, output seconds' keys, the admission's streaks."""
    p = engine._spec.policy
    return (dict(p.decisions), p.calibrator.table.tolist(), p.calibrator.num_observed, dict(p.realized.counts),
            {k: [round(x, 9) for x in v] for k, v in p.realized.emitted.items()},
            [(k, b, n) for k, b, _, _, n in p.step_times.rows()], p._plan_age, p.plan_interval(),
            sorted(p.token_seconds), dict(p._all_streaks), p.num_admission_holds, p.num_unobserved)


@pytest.mark.parametrize("mode,conc", [("adaptive-k5", 16), ("adaptive", 4)])
def test_observations_wait_while_the_policy_holds_and_decide_the_same(tok_dir, mode, conc):
    waits, seen = watched(tok_dir, mode, conc, 96)
    never, _ = watched(tok_dir, mode, conc, 0)
    for engine in (waits, never):
        run_cell(engine, conc, 8)
        for _ in range(2):
            run_cell(engine, conc, 256)
    assert not waits._spec._policy_log  # (an idle engine ran them all)
    assert max(seen["folds"]) >= 12  # they waited: a fold ran many steps' observations at once
    assert seen["plans"] and seen["priced"]
    assert not any(seen["plans"]) and not any(seen["priced"])  # no decision ran while any waited
    assert state(waits) == state(never)


def test_a_load_change_runs_them_before_its_plan(tok_dir):
    """The load rises to another bucket mid-run (eight requests join eight settled ones): the first step at it plans
    afresh, after the waiting observations ran (`_fold_unless_holding`); a fall (requests ending) is held through
    (SlotPolicy.hold_falls) and plans at the hold's end, after them too."""
    from deepinfer import SamplingParams

    engine, seen = watched(tok_dir, "adaptive-k5", 16, 96)
    run_cell(engine, 16, 8)
    spec = engine._spec
    folds_at_begin = []
    fold_unless = spec._fold_unless_holding

    def fold_unless_holding(num_seqs):
        waiting = spec._policy_waiting
        fold_unless(num_seqs)
        if waiting and not spec._policy_waiting:
            folds_at_begin.append(num_seqs)

    spec._fold_unless_holding = fold_unless_holding
    params = lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)  # noqa: E731
    for i in range(8):
        engine.add_request(f"a{i}", [10 + i, 20 + i], params(160))
    loads = []
    while engine.has_unfinished_requests():
        if len(loads) == 40:  # settled at 8 by now: 8 more join (8 -> 16 sequences)
            for i in range(8):
                engine.add_request(f"b{i}", [30 + i, 40 + i], params(96))
        engine.step()
        loads.append(len(spec.scheduler.running))
    assert 8 in loads and 16 in loads
    assert 16 in folds_at_begin  # the rise ran the waiting observations before the new load's plan
    assert seen["plans"] and not any(seen["plans"]) and not any(seen["priced"])
    assert not spec._policy_log
