"""Settled steps (spec/settled_steps.py): once the plan holds a chain measured at its load and the admission holds,
the adaptive policy keeps one step's output processing and step time in observe_every (and calibrates one
verification in observe_every); while it decides anything (a fresh plan, a priced admission, a chain not measured
yet, a probe) it keeps every step's. Its realized rates (the plan's comparator of chains) count every steady step,
settled or not; a step where a request ended counts in none."""

from __future__ import annotations

import tempfile

from chain_policies import chain_policy

from benchmarks.spec_host import VOCAB, make_engine, run_cell
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.realized_rates import RealizedRates
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy


def drafts(n: int, conf: float = 0.9, k: int = 5) -> list[HeldDraft]:
    return [HeldDraft(seq=None, num_tokens=0, tokens=[1] * k, confidence=[conf] * k) for _ in range(n)]


def policy(**fields) -> SlotPolicy:
    """Chain 5 pays (every slot accepted 0.9-0.95), slots nearly free; plans hold 8 steps, doubling to 32; realized
    rates counted from a chain's first steady step (warm_steps 0), trusted after 3."""
    settings = {"replan_every": 8, "max_replan_every": 32, "hold_after": 3, "challenge_every": 0,
                "realized": RealizedRates(warm_steps=0),
                "cost": StepCostTable([1, 4096], [0.01, 0.01 + 4095e-7])}
    return chain_policy([0.95, 0.95, 0.9, 0.9, 0.9], one=0.001, full=0.002, **{**settings, **fields})


def drive(p: SlotPolicy, steps: int, load: int = 4) -> list[tuple[bool, bool]]:
    """`steps` steps in the pipeline's order (the held drafts' admission, the plan, then the step's observations:
    its step time where kept, its realized rate always): per step, (settled, observed)."""
    out, before = [], p.chain
    for _ in range(steps):
        p.counts(drafts(load), [5] * load, load, load)
        now = p.plan_drafting(load)
        settled = p.settled()
        observed = p.observes_step()
        tokens = load * (1 + now)
        if observed:
            p.observe_step(tokens / 5000.0, load * (1 + 5), load, load, now, verified=before > 0, emitted=tokens)
        p.realized.step(load, before, now, before > 0, tokens, tokens / 5000.0)
        out.append((settled, observed))
        before = now
    return out


def test_settled_steps_keep_one_in_observe_every_and_deciding_steps_keep_all():
    p = policy()
    got = drive(p, 200)
    assert p.chain == 5
    settled = [i for i, (s, _) in enumerate(got) if s]
    assert settled and settled[0] >= 3  # not before the chain's rate was measured (3 steady steps) and held
    assert all(o for s, o in got if not s)  # a step deciding anything keeps its observations
    kept = [o for s, o in got if s]
    assert 0.2 <= sum(kept) / len(kept) <= 0.3, sum(kept) / len(kept)  # one in four
    assert p.num_unobserved == len(kept) - sum(kept)
    assert p.realized.counts[(4, 5)] == len(got) - 1  # every steady step counted (the first drafted after none)
    every = policy(observe_every=1)
    assert all(o for _, o in drive(every, 200)) and every.num_unobserved == 0


def test_a_plan_or_a_priced_admission_is_never_a_settled_step():
    p = policy()
    drive(p, 60)
    assert p.settled()
    p._plan_age = 1  # a fresh plan's step
    assert not p.settled() and p.observes_step()
    p._plan_age = 2
    p._admission_held = False  # a priced admission's step
    assert not p.settled()
    p._admission_held = True
    for flag in ("explore", "probe", "verifying_probe", "verify_all"):
        setattr(p, flag, True)
        assert not p.settled(), flag
        setattr(p, flag, False)
    p._plan_trusted = False  # the held chain not measured at its load yet
    assert not p.settled()


def test_calibration_of_settled_steps_is_sampled_and_a_probe_always_counts():
    p = policy(calibrated_after=1 << 30)
    drive(p, 60)
    assert p.settled()
    assert [p.calibrates() for _ in range(8)].count(True) == 2  # one in observe_every (4)
    p.calibrated_after, p.calibrate_stride = 0, 2
    assert [p.calibrates() for _ in range(16)].count(True) == 2  # and the calibrator's own stride on top
    p.verifying_probe = True
    assert all(p.calibrates() for _ in range(5))


def test_an_engine_samples_its_settled_steps_and_counts_every_steady_step():
    """The spec_host stand-in engine (benchmarks/spec_host.py: an adaptive engine at one sequence, priced by tables
    of the H200's shape): most of a cell's steps are settled and 3 in 4 of those keep no step time, yet its realized
    rates count every steady step but the cell's first two and its last (where the request ended)."""
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, VOCAB)
        engine = make_engine(tok, "adaptive", 1, 256)
        run_cell(engine, 1, 61)  # (past the realized rates' warm steps)
        p = engine._spec.policy
        counted = sum(p.realized.counts.values())
        timed = sum(n for _, _, _, _, n in p.step_times.rows())
        unobserved = p.num_unobserved
        got = run_cell(engine, 1, 256)
    skipped = p.num_unobserved - unobserved
    assert skipped > got["steps"] // 2  # most of the cell's steps were settled, 3 in 4 of those unobserved
    assert sum(n for _, _, _, _, n in p.step_times.rows()) - timed == got["steps"] - skipped
    assert got["steps"] - 4 <= sum(p.realized.counts.values()) - counted <= got["steps"] - 2


def test_a_requests_last_step_is_not_a_measure_of_its_chain():
    """At one sequence a closed batch ends on a step whose verification was cut to the tokens its request had left
    (max_tokens): 1 to k + 1 tokens where the chain yields k + 1. RealizedRates leaves it out (`ended`), so the chain's
    measure carried into the next batch is its own; every other steady step is counted."""
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, VOCAB)
        engine = make_engine(tok, "adaptive", 1, 256)
        p = engine._spec.policy
        p.observe_every = 1  # (every step observed: the last one too)
        run_cell(engine, 1, 61)  # (past the realized rates' warm steps)
        counted = sum(p.realized.counts.values())
        p.realized.trace = []
        run_cell(engine, 1, 61)  # 61 tokens: the ChainLM's cycles end a chain of 5 mid-draft
    ended = [t for t in p.realized.trace if t[-1] == "ended"]
    kept = [t for t in p.realized.trace if t[-1] != "ended"]
    assert len(ended) == 1 and ended[0][3] < 6, p.realized.trace[-3:]
    assert ended[0] is p.realized.trace[-1]  # the cell's last step
    assert sum(p.realized.counts.values()) - counted == len(kept) > 5


def test_the_plan_trace_records_every_decision_but_the_holds():
    """SlotPolicy.plan_trace (benchmarks/speculative.py --plan-trace): one record per plan_drafting decision that is
    not a hold, with the gains it priced chains by and the realized rates at its load."""
    p = policy(plan_trace=[])
    drive(p, 100)
    holds = sum(n for d, n in p.decisions.items() if d.startswith("chain")) - sum(
        1 for r in p.plan_trace if r["decision"].startswith("chain"))
    assert p.plan_trace and holds > 50  # most steps held the plan: not traced
    assert len(p.plan_trace) == 100 - holds
    last = p.plan_trace[-1]
    assert last["chain"] == 5 and len(last["gains"]) == 6
    assert last["realized"] and last["realized"][-1][0] == 5 and last["realized"][-1][2] >= 3  # chain, tok/s, steps


def test_a_plan_holds_through_a_fall_in_load_and_its_admission_too():
    """SlotPolicy.hold_falls: settled at 16 sequences, the load falls to 6 (another bucket): the plan keeps holding
    its chain and the admission keeps the 16-sequence streak (nothing priced, no new plan traced) until the plan's
    interval ends; with hold_falls off the first step at the new load plans (and prices its admission)."""
    for falls in (True, False):
        p = policy(plan_trace=[], hold_falls=falls)
        drive(p, 120, load=16)
        assert p.settled() and p._plan_age > 1
        left = p.plan_interval() - p._plan_age  # steps the plan still holds for
        assert left > 2
        traced, priced = len(p.plan_trace), p.num_admission_holds
        drive(p, 2, load=6)
        if falls:
            assert len(p.plan_trace) == traced and p.num_admission_holds == priced + 2 and p.chain == 5
            assert p.will_hold(6) and p.still_holds(6) and not p.still_holds(32)
        else:
            assert len(p.plan_trace) > traced and p.plan_trace[traced]["seqs"] == 6
            assert p.num_admission_holds == priced  # both admissions at 6 priced (no streak there yet)


def _policy_state(p: SlotPolicy) -> tuple:
    return (p.chain, p._plan_age, p._plan_bucket, p._held_admissions, p.num_admission_holds, p._admission_held,
            p._admitted_any, dict(p._challenge_clock), p._short_chains, p.explore, dict(p.decisions),
            dict(p._all_streaks), p.num_unobserved, len(p.plan_trace))


def test_a_settled_run_changes_the_state_as_the_full_checks_do():
    """Settled runs (SlotPolicy.settled_runs): the steps a held plan and admission are known to hold for skip their
    checks; step by step the policy's state equals a policy's without runs (challenges on, a load change, a chain
    shorter than k among them), and most settled steps ran that way."""
    on, off = (policy(plan_trace=[], challenge_every=40, settled_runs=flag) for flag in (True, False))
    taken = 0
    for load, steps in ((4, 150), (16, 60), (3, 80)):
        for _ in range(steps):
            left = on._run_left
            for p in (on, off):
                drive(p, 1, load=load)
            taken += left > on._run_left
            assert _policy_state(on) == _policy_state(off)
            assert on._run_left == 0 or on.will_hold()  # (what defers_observations takes a run's steps left for)
    assert taken > 150  # most steps ran as part of a run
    # a plan of a chain shorter than k (its fifth draft all but never accepted, a long chain dear): its held steps
    # count towards an exploration, which a run must stop short of
    runs = [chain_policy([0.95, 0.95, 0.9, 0.9, 0.02], one=0.001, full=0.02, replan_every=8, max_replan_every=32,
                         hold_after=3, challenge_every=0, realized=RealizedRates(warm_steps=0),
                         cost=StepCostTable([1, 4096], [0.01, 0.01 + 4095e-7]), plan_trace=[], explore_every=6,
                         settled_runs=flag) for flag in (True, False)]
    taken = explored = 0
    for _ in range(120):
        left = runs[0]._run_left
        for p in runs:
            drive(p, 1)
        taken += left > runs[0]._run_left
        explored += runs[0].explore
        assert runs[0]._run_left == 0 or runs[0].will_hold()
        assert _policy_state(runs[0]) == _policy_state(runs[1])
    chain = runs[0].chain
    assert 0 < chain < 5 and runs[0].decisions[f"chain{chain}"] > 50
    assert taken > 20 and explored >= 5  # runs taken, and explorations every explore_every short chains all the same
