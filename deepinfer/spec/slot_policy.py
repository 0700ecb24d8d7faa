"""SlotPolicy: static k, or the confidence scheduler's two per-step decisions (which held draft slots to verify,
and how long a chain to draft next), with the measured step times and pauses they rest on (docs/speculative.md,
"The confidence scheduler"). Used by spec/draft_slots.py (verification) and spec/pipeline.py (drafting); the chain
plan's model and choice are in spec/chain_plan.py, its challenges in spec/chain_challenge.py, the verification's
admission in spec/slot_admission.py, which steps' observations it keeps in spec/settled_steps.py, a step's time
observed in spec/step_observations.py (all inherited)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.spec.chain_challenge import ChainChallenge
from deepinfer.spec.chain_plan import ChainPlan
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.measure_plans import MeasurePlans
from deepinfer.spec.realized_rates import RealizedRates
from deepinfer.spec.recent_drafts import RecentDrafts
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.settled_steps import SettledSteps
from deepinfer.spec.slot_admission import SlotAdmission
from deepinfer.spec.step_observations import StepObservations
from deepinfer.spec.step_times import PLAIN, StepTimeRatios, load_bucket

if TYPE_CHECKING:
    from deepinfer.spec.draft_cost import DraftCostTable


_CHAIN_DECISIONS = tuple(f"chain{n}" for n in range(16))  # (plan_drafting's per-step decision keys, made once)


@dataclass
class SlotPolicy(ChainPlan, ChainChallenge, SlotAdmission, SettledSteps, MeasurePlans, StepObservations):
    """Static k, or the confidence scheduler (calibrator + step-cost table) when adaptive.

    Adaptive, two decisions per step, both fixed before the draws they decide (non-anticipating):
    - `counts`, at verification: which of the held drafts' slots to verify (the admission over their calibrated
      survival; the drafts are made, so their cost is not in it);
    - `plan_drafting`, before the step's draw (once its forward is launched) while drafting steadily (from past steps
      only, so that the one-sync step can run it; else after the draw, `plans_before_the_draw`): how long a chain the
      MTP module drafts for the next step, 0 for none (a pause). For each L in 1..k it evaluates the steady state of
      every sampling sequence holding a draft of L at each slot's moving-average confidence, the admission's best prefix
      of those slots, and chains of L drafted for those sequences (the drafting table, spec/draft_cost.py); the best L
      drafts unless plain decoding beats it by more than pause_margin, else drafting pauses. So the chain is as long as
      pays, and a load where drafting clearly loses drafts nothing.
    A pause lasts probe_every steps (plain decode steps; the MTP pass's rows are kept for the catch-up,
    spec/mtp_catchup.py); then one probe drafts full chains for probe_seqs sequences and the next step verifies
    them in full (the calibrator learns every slot's acceptance, which a step admitting nothing never shows it).
    Each pause in a row at a load (its bucket, spec/step_times.py) doubles the next one there (up to
    max_probe_every); a chain that pays resets it. A pause is the decision of its load: once the load is in a
    lower bucket for load_fall_steps steps it ends with a probe, and the plan is made again at the new load (on
    the H200, 2026-12-04, dbb32fd: the benchmark's warm-up paused at 256 sequences, and the timed runs at one
    sequence that followed spent their whole length in that pause, tau 1.04, where static k = 5 ran 1.67x).
    Measured before modelled: at a load where no speculative step has been seen (spec/step_times.py: min_count),
    the first measure_steps plans draft full chains for every sequence and their next admission verifies them in
    full (`verify_all`); where no plain step has been seen, a pause of measure_steps steps times them. So the plan
    compares measured step times and a calibration of every slot rather than the tables' prices, which on the H200
    put a plain step at 0.234 ms where it ran 0.52, and a k = 5 step at 0.88 where it ran 1.33 (the plan with no
    step seen paused at one sequence). While the chain
    is shorter than k, once every explore_every drafting steps probe_seqs sequences draft full chains (`explore`),
    so the deeper slots' confidences are seen again (the admission then decides on them like on any draft).
    Measured rates decide where they exist (session 14, spec/realized_rates.py): the plan takes each chain's
    realized gain over plain decoding at the load where both were measured, a planned pause ends by measuring the
    chain that measured best before it again (`_start_remeasure`), and the admission charges the step's measured
    fixed seconds (`_step_fixed_seconds`).
    The n-gram drafter (no drafting table, draft_cost None) keeps the rule it had: its proposals cost host time
    (the moving average draft_seconds, charged by the admission), and once an admission verifies nothing, drafting
    pauses as above.
    """

    k: int
    max_model_len: int
    calibrator: SurvivalCalibrator | None = None
    cost: StepCostTable | None = None
    cost_shapes: list[str] = field(default_factory=list)  # per profiled count: how it was timed (spec/cost_profile.py)
    draft_seconds: float = 0.0  # the last steps' drafting time (moving average; reported, n-gram's host time)
    # MTP drafting seconds by drafting sequences and chain length, profiled at start-up (spec/draft_cost.py)
    draft_cost: DraftCostTable | None = None
    probe_every: int = 32  # the length of the last pause (next_pause: the next one's at a load)
    min_probe_every: int = 32
    max_probe_every: int = 1024
    paused: int = 0
    probe: bool = True  # the next step with drafts verifies probe_seqs sequences' drafts in full (the first one does)
    probe_seqs: int = 4  # adaptive probes draft and verify at most this many sequences (a bounded cost)
    chain: int = 0  # the chain drafted after the last step (0: none); static: k
    explore_every: int = 64
    explore: bool = False  # this drafting lengthens probe_seqs sequences' chains to k (set by plan_drafting)
    verifying_probe: bool = False  # this step's admission verified a probe (set by counts, cleared by plan_drafting)
    # drafting steps a load (bucket) measures, full chains verified in full, before its plan is modelled (0: none)
    measure_steps: int = 8
    verify_all: bool = False  # the held drafts were drafted to be measured: the next admission verifies them all
    pause_bucket: int = 0  # the load bucket the current pause was decided at
    load_fall_steps: int = 4  # steps in a row in a lower bucket that end a pause
    num_load_ends: int = 0  # pauses ended by a fall in load (engine life)
    num_pauses: int = 0  # pauses started (engine life; a pause's serial number)
    _low_steps: int = 0
    _measured: dict[tuple[str, int], int] = field(default_factory=dict)  # measuring plans made, by kind and load
    _backoff: dict[int, int] = field(default_factory=dict)  # the next pause's length, by load bucket
    _short_chains: int = 0
    _admitted_any: bool = True  # whether the last verification admitted a slot (n-gram's pause rule)
    # per slot: a moving average of the held drafts' confidences (what plan_drafting prices a chain's slots at)
    mean_confidence: list[float] = field(default_factory=list)
    # the chain model's reach from the recent drafts' confidences instead (spec/recent_drafts.py; None: off)
    recent_drafts: RecentDrafts | None = None
    # measured / table-predicted seconds of the engine's decode-row steps, per kind (plain / speculative) and load
    # bucket (spec/step_times.py, fed by `observe_step`); plan_drafting scales the tables' prices by them
    step_times: StepTimeRatios = field(default_factory=StepTimeRatios)
    # host seconds of output processing per emitted token by load bucket (moving averages, `observe_output`): taken
    # out of the observed step times, because every emitted token pays it once whichever way it is emitted
    # (observe_step); per load, since a step's processing also has per-step parts that a token's share hides
    token_seconds: dict[int, float] = field(default_factory=dict)
    # realized tokens per second of the steady steps by load and chain (spec/realized_rates.py, fed by the
    # pipeline's observe_realized): where measured and fresh, they decide the plan in place of the model
    realized: RealizedRates = field(default_factory=RealizedRates)
    # while drafting steadily at one load, the chain is planned again every replan_every steps (its inputs are
    # moving averages; planning every step cost ~70 us of the policy's ~140 us a step at one sequence on this CPU)
    replan_every: int = 8  # (the hold ends early once the held chain's realized rate is first measured there)
    # a plan that repeats the last one at its load doubles the interval to the next (up to max_replan_every); any
    # other plan, or another load, starts over at replan_every. Why: every plan (the model's rates over chains 1..k)
    # and every priced admission (the hold lasts one interval) is host work on the one-sync step's path; on an H100
    # (2026-12-06, session 28, e9c2227) the adaptive mode's one-sync steps ran 0.05-0.12 ms longer than static
    # k5's drafting the same chain of 5 (1.29 / 1.19 ms at one sequence, 1.88 / 1.77 at 16), 0.89-0.94x of its rate;
    # benchmarks/spec_host.py on this CPU, host ms a step at 4 / 16 sequences: 0.642 / 1.247 at 8, 0.612 / 1.202 at
    # 32 (static k5: 0.609 / 1.129)
    max_replan_every: int = 32
    _replan_interval: int = 0  # the current interval (0: replan_every)
    _last_plan: tuple[int, int] = (0, 0)  # (bucket, chain) of the last plan
    _plan_age: int = 0  # steps the current plan has run (a plan is made when it reaches replan_every)
    _plan_bucket: int = 0  # the load bucket the current plan was made at (another load plans at once)
    _plan_trusted: bool = False  # whether its chain's realized rate was measured then (once it is: plans at once)
    # a plan drafting a chain keeps holding when the load falls to a lower bucket (requests ending), until its
    # interval ends, and the admission keeps the plan's load's streak there (`_hold_bucket`). Why: a closed batch's
    # tail passes through every lower bucket within a few steps each, and each new bucket cost a plan and hold_after
    # priced admissions before the step's forward (on an H100, session 40, at 16 sequences: 7 of a repeat's 11 plans
    # came in its last ~40 steps; a plan ~0.1 ms of host time on this CPU); speculation pays at least as well at a
    # lower load in the usual case (a step's cost grows with its tokens, the drafts are as good), so the lower load's
    # own plan would most likely draft this chain or a longer one. A pause does not carry (it ends on a fall:
    # load_fall_steps); the lower load is measured and planned when the hold's interval ends
    hold_falls: bool = True
    decisions: dict[str, int] = field(default_factory=dict)  # plan_drafting's decisions by kind (engine life)
    # a list: every decision but a hold is appended to it (`_trace_plan`; benchmarks/speculative.py --plan-trace)
    plan_trace: list | None = None
    # the admission verifies every held slot where that costs at most this fraction of the step (`_nearly_free`:
    # its rate is then within this fraction of the admission's best), or where priced, the model puts every slot's
    # rate within this fraction of the best prefix's (spec/scheduler.py `all_within`; since 2026-12-06: on an H100
    # at 256 sequences the pricing verified 954 of ~1,069 held slots a step, ~0.11 ms of an 8.6 ms step saved for
    # slots of a few percent's reach, and its streak never let `_holds_admission` skip the 0.2 ms pricing); 0:
    # always the best prefix
    admit_all_below: float = 0.02
    num_admitted_all: int = 0  # admissions that verified every held slot that way (engine life)
    # the admission holds (`_holds_admission`): after hold_after priced admissions in a row at one load verified
    # every held slot, the next replan_every - 1 verify every held slot without pricing them (nor tracking their
    # confidences), then one prices again; 0: price every step
    hold_after: int = 3
    num_admission_holds: int = 0  # admissions held that way (engine life)
    # by load bucket: its last priced admissions in a row that verified every held slot (kept while the load visits
    # other buckets: a benchmark cell's or a burst's tail passes through lower loads and comes back)
    _all_streaks: dict[int, int] = field(default_factory=dict)
    _held_admissions: int = 0  # admissions held since the last priced one
    # a plan pauses only on a clear loss (spec/chain_plan.py `_hold`): the best chain's gain over plain decoding
    # (measured, else modelled) below 1 / (1 + pause_margin); a chain within it keeps drafting
    pause_margin: float = 0.1
    # the same where the best chain's gain is realized against plain decoding measured at the load (a measure, not
    # the model's guess: the margin need only cover the measure's noise and a pause's own costs)
    measured_pause_margin: float = 0.03
    # once the calibrator has counted calibrated_after outcomes, a verification's outcomes are counted one in
    # calibrate_stride (`calibrates`; a probe's always): its counts never decay, so past ~8k outcomes (~160 a bin)
    # a step moves the table by nothing the plan can see, and counting them was most of the adaptive mode's deferred
    # host work over static k's (+43 / +94 / +259 us a step at 1 / 4 / 64 sequences, benchmarks/spec_host.py)
    calibrated_after: int = 8192
    calibrate_stride: int = 4
    _verifications: int = 0
    # a settled step (spec/settled_steps.py: the plan and the admission held, the chain measured at its load) keeps
    # its output processing, step time and calibration one step in observe_every (its realized rate always); 1: all
    observe_every: int = 4
    num_unobserved: int = 0  # settled steps whose observations were not kept (engine life)
    _settled_steps: int = 0  # settled steps in a row (the sample's clock)
    # most observations that wait while the policy holds (spec/settled_steps.py "Observations that wait")
    max_waiting_observations: int = 96
    # settled runs (spec/settled_steps.py "Settled runs"): the steps a held plan and admission are known to hold for
    # run their bookkeeping without their checks
    settled_runs: bool = True
    _run_left: int = 0  # plans of the current settled run left
    _run_admissions: int = 0  # admissions of it left
    _run_bucket: int = 0
    _run_decision: str = ""
    _admission_held: bool = False  # whether the last admission was held (`_holds_admission`)
    _remeasure_left: int = 0  # steps left drafting _remeasure_chain after a pause (`_start_remeasure`)
    _remeasure_chain: int = 0
    _remeasure_bucket: int = 0
    _measuring_pause: bool = False  # the current pause times plain steps (measure_steps), not a plan's
    # a pause the model decides alone (no gain measured against plain decoding at the load) is a check, a short pause
    # that measures plain decoding, where its best chain's gain is at least 1 / model_error: the model's prices were
    # off by ~1.7-2x at 64-256 sequences on the H200 (`_checks_pause`); at most max_checks a load bucket; 1: never
    model_error: float = 2.0
    max_checks: int = 2
    _checked: dict[int, int] = field(default_factory=dict)  # checks made, by load bucket
    _plan_gain: float = 0.0  # the last plan's best chain's gain over plain decoding (modelled or measured)
    _plan_measured: bool = False  # whether the last plan had a chain's gain measured against plain decoding
    _plan_gains: list[float] = field(default_factory=list)  # the last plan's gain per chain (index 0: plain, 1.0)
    _plan_seconds: list[float] = field(default_factory=list)  # the last plan's modelled seconds a step per chain
    # a measure overrules the model's best chain only this many standard errors apart (spec/chain_plan.py)
    measured_z: float = 1.5
    # where two drafting chains' step times are measured at one load, the plan fits the model's step times to them
    # before it fills the chains not measured (spec/chain_plan.py `_fitted_rates`); False: the model's shape scaled
    # at the nearest measure alone, as before session 30 (benchmarks/speculative.py's adaptive_nofit, the A/B)
    time_fit: bool = True
    # where that fit exists, it orders the chains (its step times measured, its tokens the calibrated survival's,
    # engine-life averages both) and the most-measured chain's realized gain scales them, in place of each measured
    # chain's own realized rate (spec/chain_plan.py `_choose_chain`)
    fit_orders: bool = False
    # "current" / "longest": where the chain drafted now / the longest chain trusted at a load has paired counts
    # (RealizedRates.paired_near), the plan's model takes its tokens from them (spec/chain_plan.py `_paired_tokens`)
    # and a challenge skips the shorter chains they price; "": off (the A/B knob: benchmarks.speculative's
    # adaptive_pcur / adaptive_plong)
    paired_model: str = ""
    # a load come back to with no chain trusted at it drafts chains of k until one is (`_visits_unmeasured`)
    measure_visits: bool = True
    # challenges (spec/chain_challenge.py): every challenge_every drafting steps at a load bucket (doubling, up to
    # max_challenge_every, after each that left the plan's chain), a chain whose gain in the plan is within
    # challenge_margin of the planned one's drafts challenge_steps steps with its measure there taken afresh; 0: never
    challenge_every: int = 64
    max_challenge_every: int = 512
    challenge_margin: float = 0.15
    challenge_steps: int = 8
    # a chain shorter than the planned one is not challenged where it cannot win even with its steps shorter than the
    # planned chain's measured ones by model_error x the model's saving (spec/chain_challenge.py `_within_reach`);
    # False: challenged whatever its tokens (as before session 41; benchmarks.speculative's adaptive_nobound)
    bound_challenges: bool = True
    num_challenges_bounded: int = 0  # shorter challengers left out that way (engine life)
    num_challenges: int = 0  # challenges started (engine life)
    num_challenges_won: int = 0  # challenges after which the plan's chain changed (engine life)
    _challenge_clock: dict[int, int] = field(default_factory=dict)  # drafting steps since the last challenge, by bucket
    _challenge_interval: dict[int, int] = field(default_factory=dict)  # by bucket (default challenge_every)
    _challenge_left: int = 0  # steps left drafting _challenge_chain
    _challenge_chain: int = 0
    _challenge_bucket: int = 0
    _challenged_from: int = 0  # the plan's chain the running or last challenge challenged (0: none pending)

    @property
    def adaptive(self) -> bool:
        return self.calibrator is not None

    def chain_length(self, index: int = 0) -> int:
        """Drafts of the index-th drafting sequence's chain (valid after plan_drafting): the planned chain, or k for
        the first probe_seqs sequences of an exploring step."""
        if not self.adaptive:
            return self.k
        return self.k if self.explore and index < self.probe_seqs else self.chain

    def drafting_seconds(self, num_seqs: int, chain: int | None = None) -> float:
        """What drafting chains of `chain` (default k) for num_seqs sequences costs."""
        if self.draft_cost is None:
            return self.draft_seconds
        return self.draft_cost.cost(num_seqs, chain)

    def plans_before_the_draw(self) -> bool:
        """Whether this step's chain may be planned before its draw (once its forward is launched, so that the one-sync
        step can run it: SpecStepPipeline._plan_chain): static
        k, or an adaptive policy drafting steadily. A step that verifies a probe, or one in a pause, plans after its
        draw (the host path): the probe's outcome is what the plan after a pause must see (planned before it, each
        plan would read the calibration of the probe before, 32 to 1024 steps old; on the H200 the first plan then
        saw no calibration at all and paused)."""
        return not self.adaptive or (self.chain > 0 and self.paused == 0 and not self.verifying_probe)

    def plan_drafting(self, num_seqs: int) -> int:
        """The chain length to draft after this step for num_seqs sampling sequences (0: no drafting). Sets
        self.chain; with self.probe set on return, only probe_seqs sequences draft (the caller's choice)."""
        self.explore = self.verifying_probe = self.verify_all = False
        bucket = load_bucket(num_seqs)
        decision = "paused"
        if not self.adaptive:
            self.chain = self.k
            return self.chain
        if self._run_left and num_seqs and self._run_step(bucket):  # a settled run (spec/settled_steps.py)
            return self.chain
        steady, self._plan_age = self._plan_age, 0  # any decision but a plan's or its hold's: the next plans afresh
        # the hold first: steady > 0 only after a plan that drafted (chain > 0, no challenge started) or its hold,
        # so nothing is paused, probed, measured, re-measured or challenged at the plan's load (each of those
        # decisions sets _plan_age to 0), and the branches below would not be taken; checking it first spares a
        # held step (most steps) their checks (`_holds_plan`). At a lower load (hold_falls) the hold comes before
        # that load's measuring plans on purpose: they run once the hold's interval ends
        if steady and num_seqs and self._holds_plan(steady, num_seqs, bucket):
            decision = _CHAIN_DECISIONS[self.chain] if self.chain < len(_CHAIN_DECISIONS) else f"chain{self.chain}"
            self._count_short()
            if self._challenge_due(bucket):
                self._plan_age = self.max_replan_every + self.replan_every  # the next step plans (and challenges)
            elif self.settled_runs and bucket == self._plan_bucket:
                self._start_run(bucket, decision)
        elif self.paused > 0 and self._load_fell(num_seqs, bucket):
            self.paused = self._low_steps = 0  # the load fell below the pause's: probe, then plan at this load
            self.probe, self.chain = True, self.k
            self.num_load_ends += 1
            decision = "load_end"
        elif self.paused > 0:
            self.paused -= 1
            self.chain = 0
            if self.paused == 0:  # the pause ends: draft the probe, and measure drafting afresh (RealizedRates)
                self.probe, self.chain, self._low_steps = True, self.k, 0
                if not self._measuring_pause:  # (a measuring pause's drafting measures are fresh)
                    self._start_remeasure(self.pause_bucket)
        elif self.probe or num_seqs == 0 or (self.draft_cost is None and self._admitted_any):
            self.chain, decision = self.k, "full"
        elif self.draft_cost is not None and self._measuring(num_seqs):
            self.chain = self.k  # a load not measured yet: full chains, verified in full (class docstring)
            self.verify_all, decision = True, "measure"
        elif self.draft_cost is not None and self._measuring(num_seqs, PLAIN):
            self.chain = 0  # nor its plain steps: a short pause (its length does not back off)
            self.paused, self.pause_bucket, self._low_steps = max(self.measure_steps - 1, 1), bucket, 0
            self.num_pauses, self._measuring_pause = self.num_pauses + 1, True
            decision = "measure_plain"
        elif self._remeasure_left > 0 and self._remeasure_bucket == bucket:
            self._remeasure_left -= 1  # after a pause: the chain measured best before it, measured again
            self.chain, decision = self._remeasure_chain, "remeasure"
        elif self._challenge_left > 0 and self._challenge_bucket == bucket:
            self._challenge_left -= 1  # a challenge runs (spec/chain_challenge.py); the plan after it compares
            self.chain, decision = self._challenge_chain, "challenge"
        elif self._visits_unmeasured(num_seqs, bucket):
            # a load come back to with no chain trusted at it: chains of k until one is (`_visits_unmeasured`)
            self._remeasure(bucket, self.k)
            self.chain, self._last_plan, decision = self.k, (bucket, 0), "visit"
        else:  # MTP: the planned chain; n-gram (no drafting table): a pause once an admission verified nothing
            self.chain = self._choose_chain(num_seqs) if self.draft_cost is not None else 0
            self._end_challenge(bucket, self.chain)
            same = self.chain > 0 and self._last_plan == (bucket, self.chain)
            self._replan_interval = min(2 * self.plan_interval(), self.max_replan_every) if same else self.replan_every
            self._last_plan = (bucket, self.chain)
            decision = f"chain{self.chain}" if self.chain else "pause"
            self._plan_age, self._plan_bucket = (1, bucket) if self.chain and self.draft_cost is not None else (0, 0)
            self._plan_trusted = self.realized.rate(num_seqs, self.chain) is not None
            if self.chain == 0 and self._checks_pause(bucket):
                # a pause the model decided alone, by less than its error: a short one that measures plain decoding
                # at this load, then the re-measure of drafting (`_start_remeasure`) and a plan on both measures
                r = self.realized
                self.paused = max(self.measure_steps, r.warm_steps + r.min_count + 2) - 1
                self.pause_bucket, self._low_steps = bucket, 0
                self.num_pauses, self._measuring_pause = self.num_pauses + 1, False
                self._checked[bucket] = self._checked.get(bucket, 0) + 1
                decision = "pause_check"
            elif self.chain == 0:
                self.probe_every = self._backoff.get(bucket, self.min_probe_every)
                # this step drafts nothing either; a new pause counts its own steps at a lower load
                self.paused, self.pause_bucket, self._low_steps = self.probe_every - 1, bucket, 0
                self.num_pauses, self._measuring_pause = self.num_pauses + 1, False
                self._backoff[bucket] = min(2 * self.probe_every, self.max_probe_every)
                if self.paused == 0:
                    self.probe, self.chain = True, self.k
            else:
                self.probe_every = self._backoff[bucket] = self.min_probe_every
                rival = self._start_challenge(num_seqs, bucket, self.chain)
                if rival != self.chain:
                    self.chain, decision, self._plan_age, self._plan_bucket = rival, "challenge", 0, 0
                self._count_short()
        self.decisions[decision] = self.decisions.get(decision, 0) + 1
        if self.plan_trace is not None and self._plan_age <= 1:  # (a hold is not a decision: not traced)
            self._trace_plan(num_seqs, decision)
        return self.chain

    def _trace_plan(self, num_seqs: int, decision: str) -> None:
        """One decision into plan_trace: the engine step (RealizedRates.now), the load, the decision and its chain,
        the gains the plan priced chains by, and the realized rates measured at the load (chain, tok/s, steps)."""
        self.plan_trace.append({"step": self.realized.now, "seqs": num_seqs, "decision": decision, "chain": self.chain,
                                "gains": [round(g, 3) for g in self._plan_gains],
                                "realized": [[c, round(r), n] for b, c, r, n in self.realized.rows() if b == num_seqs],
                                "paired": [[c, round(r)] for c, r in self.realized.paired_rows(num_seqs)]})

    def _holds_plan(self, steady: int, num_seqs: int, bucket: int) -> bool:
        """Whether the plan made `steady` steps ago holds for this step (drafting steadily at its load, or with
        hold_falls at a lower one, within plan_interval, and its chain's realized rate trusted then or still
        unmeasured); sets _plan_age if so."""
        if self._holds_at(bucket) and steady < self.plan_interval() \
                and (self._plan_trusted or self.realized.rate(num_seqs, self.chain) is None):
            self._plan_age = steady + 1
            return True
        return False

    def plan_interval(self) -> int:
        """Steps a plan holds while drafting steadily at its load (replan_every, doubling while plans repeat)."""
        return max(self._replan_interval, self.replan_every)  # (_replan_interval never passes max_replan_every)

    def _count_short(self) -> None:
        """A drafting step with a chain shorter than k: every explore_every of them, one explores (class docstring)."""
        if self.chain < self.k:
            self._short_chains += 1
            if self._short_chains >= self.explore_every:
                self._short_chains, self.explore = 0, True

    def _load_fell(self, num_seqs: int, bucket: int) -> bool:
        """Whether a pause's load has been in a lower bucket than the pause's for load_fall_steps steps in a row (a
        sequence finishing while a waiting one is admitted the step after is no change of load)."""
        self._low_steps = self._low_steps + 1 if 0 < num_seqs and bucket < self.pause_bucket else 0
        return self._low_steps >= self.load_fall_steps

    def next_pause(self, num_seqs: int) -> int:
        """Steps the next pause decided at this load would last (doubling per pause in a row there)."""
        return self._backoff.get(load_bucket(num_seqs), self.min_probe_every)
