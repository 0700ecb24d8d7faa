"""The adaptive scheduler's cost model on the cpu backend (spec/cost_profile.py, spec/draft_cost.py): profiled in
the form the engine runs, over tokens that route like real ones, and the drafting cost at the step's load."""

from __future__ import annotations

import pytest
import torch
from chain_policies import chain_policy

import deepinfer
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.models.registry import load_model
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.cost_profile import profile_step_costs
from deepinfer.spec.draft_cost import DraftCostTable, profile_draft_costs
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.mtp_catchup import PausedRows
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy
from deepinfer.spec.step_times import PLAIN, SPECULATIVE, StepTimeRatios, load_bucket


class SpyModel:
    """Delegates to a real model and records what its forward and MTP forward ran (what a profile timed)."""

    def __init__(self, model):
        self.model, self.batches, self.mtp_batches = model, [], []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, batch, caches):
        self.batches.append(batch)
        return self.model.forward(batch, caches)

    def mtp_forward(self, hidden, next_ids, batch, caches, k: int = 0):
        self.mtp_batches.append(batch)
        return self.model.mtp_forward(hidden, next_ids, batch, caches, k)


@pytest.fixture(scope="module")
def cpu_model():
    backend = CPUBackend()
    return backend, load_model(deepinfer.embedded_model_path(), backend, torch.float32, progress=False, load_mtp=True)


def test_eager_step_costs_are_timed_in_the_form_the_engine_runs_verify_steps(cpu_model):
    """The cpu backend runs an eager verify step as decode rows (decode_rows_eager); its step costs must be timed
    that way, not as varlen prefill sequences (the MLA op's per-request prefill path, which the engine no longer
    takes there), and over different token ids: one repeated id routes every token to the same experts, and the
    table then prices extra verified tokens at almost nothing (2.5x under at 16 tokens with the embedded model)."""
    backend, model = cpu_model
    spy = SpyModel(model)
    table, shapes = profile_step_costs(spy, backend, 16, 3, 8, repeats=1, decode_rows=True)
    assert table.tokens == [1, 2, 4, 8] and shapes == ["decode rows"] * 4
    assert all(b.is_decode_only for b in spy.batches) and [b.num_seqs for b in spy.batches] == [1, 2, 4, 8]
    last = spy.batches[-1]  # two verify rows of 1 + k = 4 tokens each, one decode row per token, every row's logits
    assert last.positions.tolist() == [0, 1, 2, 3] * 2 and last.seq_lens_cpu == [1, 2, 3, 4] * 2
    assert last.logits_indices.tolist() == list(range(8)) and last.slot_mapping["mla"].unique().numel() == 8
    assert last.input_ids.unique().numel() > 4
    spy.batches.clear()
    _, shapes = profile_step_costs(spy, backend, 16, 3, 8, repeats=1)
    assert shapes == ["varlen"] * 4 and not spy.batches[-1].is_decode_only  # backends without decode_rows_eager
    assert spy.batches[-1].query_lens_cpu == [4, 4] and spy.batches[-1].input_ids.unique().numel() > 4


def test_the_cpu_engine_profiles_its_costs_as_it_runs_them(cpu_model):
    """Wiring: an adaptive mtp engine on the cpu backend runs verify steps as decode rows, its step-cost table was
    profiled in that form, and it holds a drafting-cost table by sequences (spec/setup.py)."""
    from deepinfer import EngineConfig
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.text.tokenizer import Tokenizer

    backend, model = cpu_model
    path = deepinfer.embedded_model_path()
    cfg = EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64,
                       max_num_batched_tokens=64, max_num_seqs=4, load_progress=False, speculative_method="mtp",
                       num_speculative_tokens=3, speculative_adaptive=True)
    engine = DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)
    policy = engine._spec.policy
    assert engine._spec.shapes.decode_rows_eager
    assert policy.cost.tokens[-1] == 64 and policy.cost_shapes == ["decode rows"] * 7
    assert policy.draft_cost is not None and policy.draft_cost.counts == [1, 2, 4] and policy.draft_cost.k == 3
    assert all(b >= a > 0 for a, b in zip(policy.draft_cost.one.seconds, policy.draft_cost.full.seconds))


def test_drafting_cost_is_the_drafters_own_pass_and_chain_timed_by_sequences(cpu_model):
    """profile_draft_costs times MTPDrafter.run itself: per point one pass over every sequence's verified rows
    (1 + L // 2 each) and L - 1 chain links of one row per sequence, for chains of L = 1 (the pass alone) and k."""
    backend, model = cpu_model
    spy = SpyModel(model)
    table = profile_draft_costs(spy, backend, 16, 3, 4, repeats=1)
    assert table.counts == [1, 2, 4] and all(s > 0 for s in table.one.seconds + table.full.seconds)
    assert [b.num_tokens for b in spy.mtp_batches] == [1, 2, 4] + [2, 1, 1, 4, 2, 2, 8, 4, 4]
    assert spy.mtp_batches[-1].positions.tolist() == [3, 3, 3, 3]  # the last link: one position past the pass + 1
    assert profile_draft_costs(model, backend, 16, 2, 1, repeats=1).counts == [1, 2]  # max_num_seqs 1: two points


def held(n: int) -> list[HeldDraft]:
    return [HeldDraft(seq=None, num_tokens=0, tokens=[1, 2, 3], confidence=[0.95, 0.95, 0.95]) for _ in range(n)]


def test_drafting_is_planned_at_the_drafting_cost_of_this_steps_sequences():
    """A flat step cost (verified tokens nearly free) and drafts accepted 95% of the time: drafting pays where it
    is cheap (1 sequence: 4-10 ms) and not where it is not (64 sequences: 4-10 s), which pauses it. The admission
    at verification verifies every held slot either way: the drafts are made, their cost is not in it."""
    cal = SurvivalCalibrator(num_slots=3)
    cal.observe(torch.tensor([0, 1, 2] * 200), torch.full((600,), 0.95, dtype=torch.float64), torch.ones(600))
    policy = SlotPolicy(k=3, max_model_len=512, calibrator=cal, cost=StepCostTable([1, 4096], [0.1, 0.101]),
                        probe=False, measure_steps=0)
    policy.draft_cost = DraftCostTable(3, StepCostTable([1, 64], [0.004, 4.0]), StepCostTable([1, 64], [0.01, 10.0]))
    assert policy.drafting_seconds(64) == pytest.approx(10.0) and policy.drafting_seconds(64, 1) == pytest.approx(4)
    assert policy.counts(held(1), [3], 1, 1) == [3] and policy.counts(held(64), [3] * 64, 64, 64) == [3] * 64
    assert policy.mean_confidence == pytest.approx([0.95] * 3)
    assert policy.plan_drafting(1) == 3 and policy.paused == 0
    assert policy.plan_drafting(64) == 0 and policy.paused == policy.min_probe_every - 1
    assert [policy.plan_drafting(64) for _ in range(policy.paused)] == [0] * 30 + [3]  # then the probe drafts
    assert policy.probe and policy.next_pause(64) == 2 * policy.min_probe_every
    assert policy.next_pause(1) == policy.min_probe_every  # the backoff is the load's own


def test_drafting_cost_is_linear_in_the_chain_length_between_its_profiled_rows():
    table = DraftCostTable(5, StepCostTable([1, 16], [0.004, 0.014]), StepCostTable([1, 16], [0.025, 0.071]))
    assert table.cost(16, 1) == pytest.approx(0.014) and table.cost(16) == pytest.approx(0.071)
    assert table.cost(16, 3) == pytest.approx(0.014 + (0.071 - 0.014) / 2)
    assert table.cost(4, 2) == pytest.approx(float(table.one.cost(torch.tensor(4.0)))
                                             + (float(table.full.cost(torch.tensor(4.0)))
                                                - float(table.one.cost(torch.tensor(4.0)))) / 4)
    with pytest.raises(ValueError, match="chain length 6"):
        table.cost(4, 6)
    with pytest.raises(ValueError, match="same counts"):
        DraftCostTable(5, StepCostTable([1, 16], [1.0, 2.0]), StepCostTable([1, 8], [1.0, 2.0]))
    noisy = DraftCostTable(3, StepCostTable([1, 2], [0.01, 0.02]), StepCostTable([1, 2], [0.005, 0.03]))
    assert noisy.full.seconds == [0.01, 0.03]  # a longer chain never priced below a shorter one


def test_adaptive_chooses_a_short_chain_when_deep_slots_do_not_pay_for_their_links():
    """Drafts whose first slot is accepted 80% of the time and later ones rarely (5%), links that cost like the
    step itself: one draft a step is worth its pass, five are not. The next chain drafts one (where a full chain's
    cost would have paused drafting)."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    assert policy.plan_drafting(4) == 1 and policy.chain_length() == 1 and policy.paused == 0
    full_only = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.2, full=0.2)  # every chain as costly as k's
    assert full_only.plan_drafting(4) == 0 and full_only.paused > 0


def test_adaptive_keeps_the_full_chain_when_every_slot_is_accepted_and_links_are_cheap():
    policy = chain_policy([0.95] * 5, one=0.002, full=0.004)
    assert policy.plan_drafting(2) == 5 and policy.chain_length() == 5


def test_a_short_chain_is_lengthened_to_k_for_probe_seqs_sequences_every_explore_every_steps():
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    policy.explore_every, policy.probe_seqs = 3, 2
    lengths = []
    for _ in range(7):
        assert policy.plan_drafting(4) == 1
        lengths.append([policy.chain_length(i) for i in range(4)])
    explored = [5, 5, 1, 1]
    assert lengths == [[1] * 4, [1] * 4, explored, [1] * 4, [1] * 4, explored, [1] * 4]


def test_the_planned_chain_follows_the_drafts_confidence():
    """The same calibration, drafts whose mean confidence falls from 0.9 to 0.1 (the calibrator's prior there):
    their survival falls and drafting stops paying."""
    policy = chain_policy([0.9] * 5, one=0.004, full=0.012)
    assert policy.plan_drafting(4) > 0
    low = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * 5, confidence=[0.05] * 5) for _ in range(4)]
    for _ in range(40):
        policy.counts(low, [5] * 4, 4, 4)
    assert policy.mean_confidence[0] < 0.1 and policy.plan_drafting(4) == 0


def test_the_chain_is_k_for_a_static_policy_and_for_a_probe():
    static = SlotPolicy(k=3, max_model_len=512)
    assert static.plan_drafting(8) == 3 and static.chain_length() == 3
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    policy.probe = True  # the first drafting, or a pause's end: full chains for the probe
    assert policy.plan_drafting(4) == 5


def test_measured_step_times_correct_the_tables_prices():
    """The tables price one sequence's k = 1 step at 40.4 + 4 ms and a plain step at 40 ms (verified tokens almost
    free, drafts accepted 80%): drafting pays by them. Speculative steps that measure 2x their price (host work the
    tables do not see) make it not pay once plain steps are seen at their price (until then the speculative ratio
    stands in for the plain one: most overhead is host work both pay); plain steps measured alike leave the choice
    to the model again."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    times = policy.step_times
    assert policy.plan_drafting(1) == 1
    for _ in range(30):
        policy.observe_step(2 * (policy.cost.at(2) + 0.004), 2, 1, 1, 1, verified=True)
    assert times.ratio(SPECULATIVE, 1) == pytest.approx(2.0, rel=0.05) and not times.seen(PLAIN, 1)
    # no plain step seen: the speculative steps' excess stands in for it (per-step work both kinds pay)
    excess = times.overhead(SPECULATIVE, 1)
    assert excess == pytest.approx(policy.cost.at(2) + 0.004, rel=0.05)
    assert times.seconds(PLAIN, 1, policy.cost.at(1)) == pytest.approx(policy.cost.at(1) + excess)
    assert policy.plan_drafting(1) == 1
    for _ in range(30):
        policy.observe_step(policy.cost.at(1), 1, 1)
    assert times.ratio(PLAIN, 1) == pytest.approx(1.0)
    assert policy.plan_drafting(1) == 0
    policy.paused, policy.probe = 0, False
    for _ in range(60):
        policy.observe_step(2 * policy.cost.at(1), 1, 1)
    assert times.ratio(PLAIN, 1) == pytest.approx(2.0, rel=0.01) and policy.plan_drafting(1) == 1
    policy.observe_step(100.0, 1, 1)  # a stall: pulls as 2x the running ratio (spread), no further
    assert times.ratio(PLAIN, 1) == pytest.approx(0.9 * 2.0 + 0.1 * 4.0, rel=0.02)


def test_step_time_corrections_are_kept_per_load():
    """The H200's shape (2026-12-04): at one sequence a plain step ran ~2x its table price and a speculative one
    ~1.5x; at 64 sequences plain ~1x here and speculative ~4x. With the tables of chain_policy a chain of 1 pays
    when speculative / plain < ~1.6: at one sequence but not at 64. One ratio per kind over both loads (the model
    this replaced) took whichever load it saw last and planned the other load by it: after the 64-sequence steps
    it drafted nothing at one sequence."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    for _ in range(30):  # one sequence: plain and k = 1 steps
        policy.observe_step(2.0 * policy.cost.at(1), 1, 1)
        policy.observe_step(1.5 * (policy.cost.at(2) + 0.004), 2, 1, 1, 1, verified=True)
    for _ in range(30):  # then 64 sequences
        policy.observe_step(1.0 * policy.cost.at(64), 64, 64)
        policy.observe_step(4.0 * (policy.cost.at(128) + 0.004), 128, 64, 64, 1, verified=True)
    times = policy.step_times
    assert times.ratio(PLAIN, 1) == pytest.approx(2.0) and times.ratio(SPECULATIVE, 1) == pytest.approx(1.5)
    assert times.ratio(PLAIN, 64) == pytest.approx(1.0) and times.ratio(SPECULATIVE, 33) == pytest.approx(4.0)
    assert policy.plan_drafting(1) == 1
    assert policy.plan_drafting(64) == 0 and policy.paused > 0
    rows = [(kind, bucket, round(r, 3)) for kind, bucket, r, _, _ in times.rows()]
    assert rows == [(PLAIN, 1, 2.0), (PLAIN, 64, 1.0), (SPECULATIVE, 1, 1.5), (SPECULATIVE, 64, 4.0)]


def test_an_unseen_kind_is_priced_by_the_other_kinds_excess_at_that_load():
    """The H200 at one sequence (2026-12-04, f7bf36c): plain steps ran 0.295 + 0.88 ms (x3.97) and a static
    k = 5 step 1.03 + 1.19 ms (x2.15, 2.46x off's tokens per second). Before the adaptive mode has drafted at a load
    it knows only the plain steps; with the per-slot acceptance its probes saw there (a chain of 5 yields ~3.2
    tokens), their excess added to a k = 5 step's price (1.91 ms) says the chain pays, where their ratio (4.1 ms)
    said it did not and the mode never drafted (tau 1.00)."""
    k = 5
    cal = SurvivalCalibrator(num_slots=k)
    for j, rate in enumerate([0.60, 0.78, 1.00, 0.71, 1.00]):  # what the adaptive mode's probes saw on the H200
        cal.observe(torch.full((1000,), j), torch.full((1000,), 0.9, dtype=torch.float64),
                    (torch.arange(1000) < rate * 1000).to(torch.float64))
    drafts = DraftCostTable(k, StepCostTable([1, 64], [0.382e-3, 0.551e-3]), StepCostTable([1, 64], [0.738e-3, 1.145e-3]))
    policy = SlotPolicy(k=k, max_model_len=4096, calibrator=cal, draft_cost=drafts, probe=False,
                        cost=StepCostTable([1, 8, 512], [0.295e-3, 0.295e-3, 0.436e-3]), mean_confidence=[0.9] * k,
                        measure_steps=0, pause_margin=0.0)
    for _ in range(50):
        policy.observe_step(policy.cost.at(1) + 0.88e-3, 1, 1)
    assert policy.step_times.ratio(PLAIN, 1) == pytest.approx(3.98, rel=0.01)
    assert policy.step_times.seconds(SPECULATIVE, 1, 1.033e-3) == pytest.approx(1.913e-3, rel=0.01)
    assert policy.plan_drafting(1) == k
    by_ratio = SlotPolicy(k=k, max_model_len=4096, calibrator=cal, draft_cost=drafts, probe=False, cost=policy.cost,
                          mean_confidence=[0.9] * k, measure_steps=0, pause_margin=0.0)
    by_ratio.step_times.ratios[(SPECULATIVE, 1)] = policy.step_times.ratio(PLAIN, 1)  # the old stand-in
    by_ratio.step_times.overheads[(SPECULATIVE, 1)] = 0.0
    by_ratio.step_times.ratios[(PLAIN, 1)] = policy.step_times.ratio(PLAIN, 1)
    by_ratio.step_times.overheads[(PLAIN, 1)] = 0.88e-3
    assert by_ratio.plan_drafting(1) == 0


def test_transition_steps_are_not_observed():
    """A probe's verification (verified, drafted nothing: the step that enters a pause) and a drafting step that
    verified nothing (after a prompt or a pause) are transitions; only the steady states set the ratios. The H200's
    trap (2026-12-04): probe verifications at 4.6x their price were the speculative side's only observations at one
    sequence and kept every plan paused; here, priced by them, no chain would pay (test above)."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    for _ in range(10):
        policy.observe_step(2.0 * policy.cost.at(1), 1, 1)  # plain
        policy.observe_step(4.6 * policy.cost.at(6), 6, 1, verified=True)  # a probe's verification, no drafts
        policy.observe_step(4.6 * (policy.cost.at(1) + 0.2), 1, 1, 1, 5)  # drafted, nothing verified
    assert [(kind, bucket) for kind, bucket, *_ in policy.step_times.rows()] == [(PLAIN, 1)]
    assert policy.plan_drafting(1) == 1  # the plain ratio stands in for the unseen speculative side


def test_small_admissions_in_plain_floats_choose_as_the_numpy_path(monkeypatch):
    """SlotPolicy.counts takes plain floats up to SMALL_ADMISSION slots; the numpy path (forced with the limit at
    0) chooses the same counts and tracks the same mean confidences over a run of random drafts (ragged, all of one
    length, caps of 0)."""
    import random

    import deepinfer.spec.slot_admission as ds

    rng = random.Random(2)
    fast = chain_policy([0.8, 0.6, 0.4, 0.3, 0.2], one=0.004, full=0.02)
    slow = chain_policy([0.8, 0.6, 0.4, 0.3, 0.2], one=0.004, full=0.02)
    for step in range(90):
        b = rng.randint(1, 6)
        same = step % 3 == 1  # every draft as long (the numpy path's one-call matrix)
        drafts = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * n, confidence=[rng.random() for _ in range(n)])
                  for n in ((4 if same else rng.randint(1, 5)) for _ in range(b))]
        caps = [0] * b if step % 15 == 7 else [rng.randint(0, 5) for _ in range(b)]
        monkeypatch.setattr(ds, "SMALL_ADMISSION", 10**6)
        got = fast.counts(drafts, caps, b, b)
        monkeypatch.setattr(ds, "SMALL_ADMISSION", 0)
        want = slow.counts(drafts, caps, b, b)
        assert got == want, step
    assert fast.mean_confidence == pytest.approx(slow.mean_confidence, rel=1e-12)


def test_slots_that_cost_nearly_nothing_are_all_verified_within_the_bound():
    """admit_all_below: where verifying every held slot costs at most that fraction of the step without them, the
    admission verifies them all (counted in num_admitted_all); priced (admit_all_below 0), the same held drafts
    lose their unlikely slots. Over random drafts and tables, whenever it verifies all, the modelled rate of all
    is within the bound of the best admission's (spec/scheduler.py admit_array's optimum)."""
    import random

    import numpy as np

    from deepinfer.spec.scheduler import admit_array

    def policy(below: float, rise: float) -> SlotPolicy:
        return chain_policy([0.9, 0.5, 0.2, 0.1, 0.05], one=0.004, full=0.02, admit_all_below=below,
                            cost=StepCostTable([1, 4096], [0.001, 0.001 + 4095 * rise]))

    held = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * 5, confidence=[0.9] * 5) for _ in range(4)]
    cheap = policy(0.02, 1e-5)  # 20 slots: 0.2 ms on a step of 21 ms (its drafting included), < 2%
    assert cheap.counts(held, [5] * 4, 4, 4) == [5] * 4 and cheap.num_admitted_all == 1
    priced = policy(0.0, 1e-5)  # the fifth slots (reach 0.9 x 0.5 x 0.2 x 0.1 x 0.05) do not pay for their 10 us
    assert sum(priced.counts(held, [5] * 4, 4, 4)) < 20 and priced.num_admitted_all == 0
    dear = policy(0.02, 1e-3)  # 20 ms for the 20 slots: priced
    assert sum(dear.counts(held, [5] * 4, 4, 4)) < 20 and dear.num_admitted_all == 0

    rng = random.Random(5)
    checked = 0
    for _ in range(300):
        below, b = rng.choice([0.01, 0.02, 0.05]), rng.randint(1, 8)
        p = policy(below, rng.choice([1e-7, 1e-6, 1e-5, 1e-4]))
        p.calibrator = SurvivalCalibrator(num_slots=5)
        lens = [rng.randint(1, 5) for _ in range(b)]
        drafts = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * n, confidence=[rng.random() for _ in range(n)])
                  for n in lens]
        if p.counts(drafts, lens, b, b) != lens or not p.num_admitted_all:
            continue
        checked += 1
        surv = np.zeros((b, 5))
        for i, d in enumerate(drafts):
            surv[i, : lens[i]] = p.calibrator.survival_row(d.confidence, lens[i])
        fixed = p._step_fixed_seconds(b)
        _, best_tokens, best_seconds = admit_array(surv, np.asarray(lens), p.cost, b, float(b), draft_seconds=fixed)
        reach = np.cumprod(surv, axis=1)
        all_tokens = b + sum(reach[i, : lens[i]].sum() for i in range(b))
        all_seconds = p.cost.at(b + sum(lens)) + fixed
        assert all_tokens / all_seconds >= best_tokens / best_seconds / (1 + below) * (1 - 1e-12)
    assert checked >= 100


def test_the_chain_is_planned_before_the_draw_only_while_drafting_steadily():
    """Static k always; adaptive after a plan that drafted, not when the step verifies a probe (the plan must see
    its outcome), not in a pause, not before the first plan."""
    assert SlotPolicy(k=3, max_model_len=512).plans_before_the_draw()
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    assert not policy.plans_before_the_draw()  # no chain planned yet
    assert policy.plan_drafting(1) == 1 and policy.plans_before_the_draw()
    policy.probe = True
    assert policy.counts(held(1), [3], 1, 1) == [3]  # the probe: verified in full
    assert not policy.plans_before_the_draw()
    assert policy.plan_drafting(1) == 1 and policy.plans_before_the_draw()
    policy.paused = 3
    assert policy.plan_drafting(1) == 0 and not policy.plans_before_the_draw()


def test_host_path_speculative_steps_are_not_observed_where_the_steady_state_is_one_sync():
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    for _ in range(5):
        policy.observe_step(2.86 * (policy.cost.at(2) + 0.004), 2, 1, 1, 1, verified=True, off_path=True)
    assert not policy.step_times.rows()
    for _ in range(5):
        policy.observe_step(1.5 * (policy.cost.at(2) + 0.004), 2, 1, 1, 1, verified=True)
        policy.observe_step(2.0 * policy.cost.at(1), 1, 1, off_path=True)  # a plain step: observed either way
    assert policy.step_times.ratio(SPECULATIVE, 1) == pytest.approx(1.5)
    assert policy.step_times.ratio(PLAIN, 1) == pytest.approx(2.0)


def test_the_calibrator_refits_early_while_observations_are_few():
    """At one sequence an adaptive engine observes ~5 slots a probe, probes 32 to 1024 steps apart: the table must
    leave its prior (survival = confidence) after the first probes, not after 64 observations. The embedded model's
    deeper drafts have confidence ~0.5 and are accepted ~80% of the time (H200, k = 5)."""
    cal = SurvivalCalibrator(num_slots=5)
    conf = torch.tensor([0.79, 0.57, 0.55, 0.49, 0.51], dtype=torch.float64)
    prior = cal.estimate(torch.arange(5), conf).clone()
    for _ in range(3):  # three probes, every slot accepted
        cal.observe(torch.arange(5), conf, torch.ones(5))
    now = cal.estimate(torch.arange(5), conf)
    assert (now > prior + 0.1).all(), (prior, now)
    fits = 0
    for _ in range(200):  # later refits are spaced out: at most one per eighth of what was seen, and every 64
        cal.observe(torch.arange(5), conf, torch.ones(5))
        fits += cal._since_fit == 0
    assert 10 <= fits <= 40


def test_one_step_is_not_a_steady_state():
    """A kind's own numbers at a load price its steps after min_count (3) observations, which start its averages at
    their medians: one slow step (the H200's x2.86 speculative step at one sequence, a kernel compiled in a step)
    does not decide alone."""
    times = StepTimeRatios()
    times.observe(PLAIN, 1, 0.002, 0.001)
    times.observe(PLAIN, 1, 0.002, 0.001)
    times.observe(SPECULATIVE, 1, 0.006, 0.002)
    assert not times.seen(SPECULATIVE, 1) and not times.seen(PLAIN, 1)
    assert times.seconds(SPECULATIVE, 1, 0.002) == 0.002  # nothing trusted yet: the tables
    times.observe(PLAIN, 1, 0.005, 0.001)
    assert times.seen(PLAIN, 1) and times.ratio(PLAIN, 1) == pytest.approx(2.0)  # the median of 2, 2, 5
    assert times.seconds(SPECULATIVE, 1, 0.002) == pytest.approx(0.003)  # the plain excess (1 ms), added
    for _ in range(2):
        times.observe(SPECULATIVE, 1, 0.003, 0.002)
    assert times.seen(SPECULATIVE, 1) and times.ratio(SPECULATIVE, 1) == pytest.approx(1.5)  # of 3, 1.5, 1.5
    assert times.seconds(SPECULATIVE, 1, 0.002) == pytest.approx(0.003)
    times.observe(PLAIN, 1, 0.1, 0.001)  # a stall after the first three: pulls at most to 2x the running ratio
    assert times.ratio(PLAIN, 1) == pytest.approx(0.9 * 2.0 + 0.1 * 4.0)


def test_step_time_buckets_and_their_fallbacks():

    assert [load_bucket(n) for n in (0, 1, 2, 3, 4, 5, 64, 65, 256)] == [1, 1, 2, 4, 4, 8, 64, 128, 256]
    times = StepTimeRatios(weight=0.5, min_count=1)
    assert times.seconds(PLAIN, 8, 0.5) == 0.5 and times.overhead(PLAIN, 8) is None  # nothing seen: the tables
    times.observe(PLAIN, 1, 0.003, 0.001)
    assert times.ratio(PLAIN, 64) == pytest.approx(3.0) and times.ratio(SPECULATIVE, 64) == pytest.approx(3.0)
    assert times.seconds(SPECULATIVE, 64, 0.01) == pytest.approx(0.03)  # a far bucket: its ratio
    assert times.seconds(SPECULATIVE, 1, 0.01) == pytest.approx(0.012)  # the same bucket: its excess, added
    assert times.overhead(PLAIN, 1) == pytest.approx(0.002) and times.overhead(PLAIN, 2) is None
    times.observe(SPECULATIVE, 64, 0.008, 0.002)
    assert times.seconds(PLAIN, 64, 0.001) == pytest.approx(0.007)  # the same bucket's other kind before a far one
    assert times.seconds(PLAIN, 64, 0.010) == pytest.approx(0.016)
    times.observe(SPECULATIVE, 32, 0.001, 0.002)  # excess -1 ms: a price is never corrected below 0.1x
    assert times.seconds(PLAIN, 32, 0.0005) == pytest.approx(0.00005)
    del times.ratios[(SPECULATIVE, 32)], times.overheads[(SPECULATIVE, 32)], times.counts[(SPECULATIVE, 32)]
    assert times.ratio(SPECULATIVE, 2) == pytest.approx(4.0)  # the nearest bucket of the same kind
    times.observe(SPECULATIVE, 2, 0.001, 0.001)
    assert times.ratio(SPECULATIVE, 4) == pytest.approx(1.0)  # 4 is as near 2 as 8; then nearer than 64
    assert times.ratio(SPECULATIVE, 16) == pytest.approx(4.0)  # 16 is nearer 64 (2 doublings) than 2 (3)
    times.observe(SPECULATIVE, 2, 0.003, 0.001)  # x3 against a running x1: pulls as x2 (spread)
    assert times.ratio(SPECULATIVE, 2) == pytest.approx(0.5 * 1.0 + 0.5 * 2.0)
    times.observe(PLAIN, 1, 1.0, 0.001)  # x1000: clamped at 10x, then at 2x the running x3
    assert times.ratio(PLAIN, 1) == pytest.approx(0.5 * 3.0 + 0.5 * 6.0)
    with pytest.raises(ValueError, match="step kind"):
        times.observe("verify", 1, 1.0, 1.0)


def test_plain_steps_at_an_unseen_load_are_priced_by_the_neighbouring_buckets_plain_steps():
    """A plain step at a bucket where only speculative steps were seen: priced by the plain ratio of the bucket
    next to it (half or twice; the mean of both) before the speculative steps' excess; two buckets away, the
    excess as before. A speculative step keeps its order (the plain steps' excess at its own bucket)."""
    times = StepTimeRatios(min_count=1)
    times.observe(PLAIN, 64, 0.003, 0.001)  # x3
    times.observe(SPECULATIVE, 32, 0.007, 0.002)  # +5 ms
    times.observe(SPECULATIVE, 16, 0.007, 0.002)
    assert times.neighbour_ratio(PLAIN, 32) == pytest.approx(3.0) and times.neighbour_ratio(PLAIN, 16) is None
    assert times.seconds(PLAIN, 32, 0.001) == pytest.approx(0.003)  # not 0.001 + 5 ms
    assert times.seconds(PLAIN, 16, 0.001) == pytest.approx(0.006)  # no plain neighbour: the excess
    times.observe(PLAIN, 16, 0.001, 0.001)  # x1
    assert times.seconds(PLAIN, 32, 0.001) == pytest.approx(0.002)  # both neighbours: their mean
    times.observe(PLAIN, 8, 0.002, 0.001)  # +1 ms
    # a speculative step at 8 (speculative steps seen at 16, x3.5): the plain steps' excess at 8, not 16's ratio
    assert times.seconds(SPECULATIVE, 8, 0.001) == pytest.approx(0.002)


def test_a_load_next_to_one_whose_plain_steps_were_timed_needs_no_measuring_pause():
    """Closed batches lose sequences step by step: each new bucket of plain steps paid a measuring pause
    (measure_steps plain steps). Where the bucket next to it timed plain steps, the plan models the load at once."""
    policy = chain_policy([0.9] * 5, one=0.0002, full=0.0004)
    policy.measure_steps = 4
    for n in (64, 32, 16):  # speculative steps seen at every load
        for _ in range(3):
            policy.observe_step(policy.cost.at(6 * n) + 0.002, 6 * n, n, n, 5, verified=True)
    for _ in range(3):
        policy.observe_step(policy.cost.at(64) + 0.001, 64, 64)  # plain steps at 64 only
    assert policy.plan_drafting(32) == 5 and policy.paused == 0 and "measure_plain" not in policy.decisions
    assert policy.plan_drafting(16) == 0 and policy.paused == 3 and policy.decisions["measure_plain"] == 1


def test_a_calibrated_policy_counts_one_verification_in_calibrate_stride_and_every_probe():
    """Below calibrated_after outcomes every verification is counted; past it one in calibrate_stride (by the
    verification's index, whatever it drew), and a probe's always (the plan after a pause reads it)."""
    policy = chain_policy([0.9] * 5, one=0.001, full=0.002, calibrated_after=10_000, calibrate_stride=4)
    assert policy.calibrator.num_observed == 5000
    assert [policy.calibrates() for _ in range(4)] == [True] * 4
    policy.calibrator.observe_lists([0] * 5000, [0.9] * 5000, [1.0] * 5000)
    assert [policy.calibrates() for _ in range(8)] == [False, False, False, True] * 2
    policy.verifying_probe = True
    assert [policy.calibrates() for _ in range(3)] == [True] * 3
    static = SlotPolicy(k=3, max_model_len=512)
    assert not static.calibrates()  # no calibrator: nothing to count


def test_ngram_drafting_pauses_once_an_admission_verifies_nothing():
    """The n-gram drafter has no drafting table: its proposals cost host time (draft_seconds, a moving average of
    the measured proposal time, charged by the admission). Once an admission verifies nothing, drafting pauses;
    while admissions verify something, it goes on."""
    cal = SurvivalCalibrator(num_slots=3)
    cal.observe(torch.tensor([0, 1, 2] * 200), torch.full((600,), 0.95, dtype=torch.float64), torch.ones(600))
    policy = SlotPolicy(k=3, max_model_len=512, calibrator=cal, cost=StepCostTable([1, 4096], [0.1, 0.101]),
                        probe=False, draft_seconds=0.001)
    assert policy.counts(held(2), [3, 3], 2, 2) == [3, 3] and policy.plan_drafting(2) == 3 and policy.paused == 0
    policy.draft_seconds = 10.0  # proposals that cost more than any verified token yields
    assert policy.counts(held(2), [3, 3], 2, 2) == [0, 0]
    assert policy.plan_drafting(2) == 0 and policy.paused == policy.min_probe_every - 1


def test_a_load_is_measured_before_it_is_modelled():
    """Where no speculative step has been seen at a load, the plan drafts full chains and the next admission
    verifies them all (whatever the model says: here drafting costs 5x a step and would pause); once min_count
    speculative steps are seen there, or after measure_steps measuring plans, the model plans. The H200's trap
    (2026-12-04, dbb32fd): with nothing seen, the tables priced a plain step at 0.234 ms (it ran 0.52) and a k = 5
    step at 0.88 ms (it ran 1.33), and the first plan at one sequence paused."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.2, full=0.2)
    policy.measure_steps, policy.measure_visits = 4, False  # (a load's visits: test_spec_paired_tokens.py)
    assert policy.plan_drafting(1) == 5 and policy.verify_all and policy.plans_before_the_draw()
    low = [HeldDraft(seq=None, num_tokens=0, tokens=[1] * 5, confidence=[0.05] * 5)]
    assert policy.counts(low, [5], 1, 1) == [5] and not policy.verify_all  # every slot, however unlikely
    for _ in range(3):  # speculative steps measured at their price
        policy.observe_step(policy.cost.at(6) + 0.2, 6, 1, 1, 5, verified=True)
    assert policy.step_times.seen(SPECULATIVE, 1)
    # no plain step seen: a pause of measure_steps steps times them (the backoff is not touched)
    assert policy.plan_drafting(1) == 0 and policy.paused == 3 and not policy.verify_all
    for _ in range(3):
        policy.observe_step(policy.cost.at(1), 1, 1)
        assert policy.plan_drafting(1) == (5 if policy.paused == 0 else 0)
    assert policy.probe and policy.next_pause(1) == policy.min_probe_every
    policy.counts(held(1), [3], 1, 1)  # the probe's verification, then the model (drafting does not pay) decides
    assert policy.plan_drafting(1) == 0 and policy.paused == policy.min_probe_every - 1
    # a load where speculative steps are never observed is measured measure_steps times, plain steps twice, then
    # modelled
    plans = []
    for _ in range(7):
        policy.paused = 0
        plans.append((policy.plan_drafting(64), policy.verify_all, policy.paused))
    assert plans == [(5, True, 0)] * 4 + [(0, False, 3)] * 2 + [(0, False, policy.min_probe_every - 1)]
    assert not policy.step_times.seen(SPECULATIVE, 64)


def test_a_pause_ends_when_the_load_falls_below_the_load_it_was_decided_at():
    """A pause decided at 64 sequences goes on at 64 and above, and ends with a probe once the load is in a lower
    bucket for load_fall_steps (4) steps in a row (the benchmark's warm-up paused at 256 and its one-sequence runs
    never drafted); the next pause at a load doubles only that load's length."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    policy.draft_cost = DraftCostTable(5, StepCostTable([1, 32, 64], [0.004, 0.004, 4.0]),
                                       StepCostTable([1, 32, 64], [0.2, 0.2, 10.0]))
    assert policy.plan_drafting(64) == 0 and policy.paused == 31 and policy.pause_bucket == 64
    assert policy.plan_drafting(100) == 0 and policy.plan_drafting(33) == 0 and policy.paused == 29
    assert [policy.plan_drafting(n) for n in (32, 32, 32, 64, 32, 32, 32)] == [0] * 7  # 4 in a row end it
    assert policy.plan_drafting(32) == 5 and policy.probe and policy.paused == 0 and policy.num_load_ends == 1
    assert policy.counts(held(4), [3] * 4, 4, 4) == [3] * 4 and policy.verifying_probe  # the probe, in full
    assert policy.plan_drafting(32) == 1 and policy.next_pause(32) == 32
    assert policy.next_pause(64) == 64
    # a new pause counts its own steps at a lower load: a pause at 64 whose last 3 steps ran at 32 ends by its length
    policy.paused, policy.pause_bucket = 3, 64
    assert [policy.plan_drafting(32) for _ in range(3)] == [0, 0, 5] and policy.num_load_ends == 1
    policy.probe = False
    # the pause's end measures drafting at its load afresh (SlotPolicy._start_remeasure), then the model pauses there
    steps = policy.realized.warm_steps + policy.realized.min_count + 1
    assert [policy.plan_drafting(64) for _ in range(steps)] == [5] * steps
    assert policy.plan_drafting(64) == 0 and policy.pause_bucket == 64  # the next pause there (64 steps)
    assert [policy.plan_drafting(32) for _ in range(3)] == [0] * 3 and policy.paused > 0  # not 1 step at 32
    assert policy.plan_drafting(32) == 5 and policy.num_load_ends == 2


def test_paused_rows_that_would_be_dropped_before_the_pause_ends_are_not_kept():
    rows = PausedRows(max_rows=4096)
    assert rows.worth_keeping(256, 16) and not rows.worth_keeping(256, 17)
    assert rows.worth_keeping(1, 1024) and rows.worth_keeping(4096, 0) and not rows.worth_keeping(4097, 1)


def test_a_speculative_price_is_the_plain_steps_excess_plus_the_price_scaled_by_the_rest():
    """Both kinds seen at a load: plain steps priced 1 ms ran 2 (1 ms of per-step work), speculative ones priced 2 ms
    ran 3.2. A 4 ms chain is then 1 + 4 x 1.1 = 5.4 ms (its own observed price gives back its observed time), where
    the speculative ratio alone said 6.4: the per-step work does not grow with the chain."""
    times = StepTimeRatios()
    for _ in range(3):
        times.observe(PLAIN, 8, 2e-3, 1e-3)
        times.observe(SPECULATIVE, 8, 3.2e-3, 2e-3)
    assert times.seconds(SPECULATIVE, 8, 2e-3) == pytest.approx(3.2e-3)
    assert times.seconds(SPECULATIVE, 8, 4e-3) == pytest.approx(5.4e-3)
    assert times.seconds(PLAIN, 8, 1e-3) == pytest.approx(2e-3)
    assert times.seconds(SPECULATIVE, 16, 4e-3) == pytest.approx(4e-3 * 1.6)  # elsewhere: the nearest ratio


def test_output_processing_per_token_is_taken_out_of_the_observed_step_times():
    """A step's output processing (measured per emitted token) is paid once per token however it is emitted: a
    speculative step emitting 5 tokens at 0.1 ms each is compared with the tables after taking 0.5 ms out."""
    policy = chain_policy([0.8, 0.05, 0.05, 0.05, 0.05], one=0.004, full=0.2)
    policy.observe_output(0.5e-3, 5, 1)
    policy.observe_output(0.5e-3, 50, 20)  # another load's: not this one's
    assert policy.token_seconds == pytest.approx({1: 0.1e-3, 32: 0.01e-3})
    price = policy.cost.at(6) + policy.drafting_seconds(1, 5)
    for _ in range(3):
        policy.observe_step(price + 0.5e-3, 6, 1, 1, 5, verified=True, emitted=5)
        policy.observe_step(policy.cost.at(1) + 0.1e-3, 1, 1)
    assert policy.step_times.ratio(SPECULATIVE, 1) == pytest.approx(1.0)
    assert policy.step_times.ratio(PLAIN, 1) == pytest.approx(1.0)


def test_a_speculative_price_takes_the_neighbouring_buckets_plain_excess_as_fixed():
    """Speculative steps seen at one sequence (priced 0.6 ms, ran 1.1: the H100's x1.81 of 2026-12-06) and plain
    steps only at the next bucket (+0.5 ms of per-step work): a chain priced 0.743 ms is 0.5 + 0.743 x 1.0 ms, not
    0.743 x 1.83 (the ratio scales the per-step host work with the chain). Plain steps two doublings away count;
    three do not. Without one, the ratio."""
    times = StepTimeRatios()
    for _ in range(3):
        times.observe(SPECULATIVE, 1, 1.1e-3, 0.6e-3)
    assert times.plain_overhead_near(1) is None
    assert times.seconds(SPECULATIVE, 1, 0.743e-3) == pytest.approx(0.743e-3 * 1.1 / 0.6)
    for _ in range(3):
        times.observe(PLAIN, 2, 0.726e-3, 0.226e-3)  # +0.5 ms
    assert times.plain_overhead_near(1) == pytest.approx(0.5e-3) and times.plain_overhead_near(16) is None
    assert times.seconds(SPECULATIVE, 1, 0.6e-3) == pytest.approx(1.1e-3)  # its own observed price: its time
    assert times.seconds(SPECULATIVE, 1, 0.743e-3) == pytest.approx(0.5e-3 + 0.743e-3)
    assert times.seconds(SPECULATIVE, 4, 0.743e-3) == pytest.approx(0.743e-3 * 1.1 / 0.6)  # 4: not seen there
    far = StepTimeRatios()
    for _ in range(3):
        far.observe(SPECULATIVE, 1, 1.1e-3, 0.6e-3)
        far.observe(PLAIN, 4, 0.726e-3, 0.226e-3)  # two doublings away: taken
        far.observe(PLAIN, 8, 1.226e-3, 0.226e-3)  # three: not
    assert far.plain_overhead_near(1) == pytest.approx(0.5e-3) and far.plain_overhead_near(64) is None


def test_a_speculative_price_keeps_its_drafting_at_the_drafting_tables_price():
    """Speculative steps at one sequence priced 0.214 ms of forward + 0.294 of drafting (a chain of 3) ran 0.966 ms,
    and plain steps there +0.214 ms over their price (an H100's numbers, 2026-12-06): the excess beyond the plain
    steps' goes to the forward's part, and a chain of 5 (drafting 0.399 ms, the same flat forward) is priced 0.105
    ms above the chain of 3, the drafting table's difference (static k5 ran 0.086 ms above k3 there), where scaling
    the whole price priced it 0.164 ms above. Without a plain step near, a = 0 and the same split holds."""
    times = StepTimeRatios()
    for _ in range(3):
        times.observe(SPECULATIVE, 1, 0.966e-3, 0.214e-3 + 0.294e-3, 0.294e-3)
        times.observe(PLAIN, 1, 0.428e-3, 0.214e-3)
    three = times.seconds(SPECULATIVE, 1, 0.214e-3 + 0.294e-3, 0.294e-3)
    five = times.seconds(SPECULATIVE, 1, 0.214e-3 + 0.399e-3, 0.399e-3)
    assert three == pytest.approx(0.966e-3)  # its own observed price gives back its observed time
    assert five - three == pytest.approx(0.105e-3)
    whole = times.seconds(SPECULATIVE, 1, 0.214e-3 + 0.399e-3) - times.seconds(SPECULATIVE, 1, 0.214e-3 + 0.294e-3)
    assert whole > 0.15e-3  # the price scaled whole (no drafting part given): the old, larger difference
    alone = StepTimeRatios()
    for _ in range(3):
        alone.observe(SPECULATIVE, 1, 0.966e-3, 0.214e-3 + 0.294e-3, 0.294e-3)
    assert alone.plain_overhead_near(1) is None
    assert alone.seconds(SPECULATIVE, 1, 0.508e-3, 0.294e-3) == pytest.approx(0.966e-3)
    assert alone.seconds(SPECULATIVE, 1, 0.613e-3, 0.399e-3) - alone.seconds(SPECULATIVE, 1, 0.508e-3, 0.294e-3) \
        == pytest.approx(0.105e-3)
