"""Which steps' observations the adaptive policy keeps (spec/slot_policy.py's SlotPolicy inherits it): every step's
while it decides, and once it has settled, its output processing, step time and calibration one step in
observe_every; its realized rate every step.

Why. Static k observes nothing; the confidence scheduler observes every step it runs: the step's output processing
and wall time against the tables (spec/step_times.py), its realized rate (spec/realized_rates.py) and its drafts'
outcomes (spec/confidence.py, refitted every few dozen outcomes). On the embedded model the steps are host-bound
(a one-sync step of ~1 ms at one sequence, the device busy a fraction of it), so that bookkeeping is paid: on an
H100 (2026-12-07, session 37) the adaptive mode ran 0.92-0.96x of static k = 5 at every load where it drafted
chains of 5 like it, its slot policy's host time 78 us a step against static k5's 37; on this CPU
(benchmarks/spec_host.py, one sequence) the adaptive mode's deferred work was 32 us a step against 7, its
observations ~45 us (the calibrator's refits 25 of them, step times 9, realized rates 4).

A settled step is one where the adaptive policy is running static k's step: the plan holds a chain whose realized
rate was measured at its load (SlotPolicy._plan_trusted, a hold of plan_drafting), the admission held (every held
slot verified unpriced), nothing paused, probed, explored or measured. What its step time and outcomes would feed
is a plan and an admission that are not being made; the next ones, at most plan_interval() steps later, read moving
averages (step-time ratios, output seconds a token) and counts (the calibration) that a sample of the steps keeps
as well as all of them do. So a settled step keeps those one step in observe_every (by the steps' count: the step's
index decides, never its outcomes or times, so the sample is non-anticipating and unbiased). Every other step,
while the policy is deciding anything, keeps all of them.

The realized rates are kept every step. They are the plan's comparator of chains, and a chain's rate moves within a
closed batch (its first steps' drafts are accepted less: on an H100, session 38, a chain of 5 at 4 sequences ran
4.5-9k tok/s in a batch's first steps and 14-19k later); sampled, the held chain's moving average spans four times
the steps, so a batch's hard first steps weighed in it four times as long. The first H100 sweeps of this sampling
(session 38, calls 1-3, sampling the realized rates too) drafted the chain of 5 in 49%, 58% and 74% of the adaptive
mode's steps at 4 sequences, against 83% and 89% with every step observed (the best static mode there: k5 or k3,
within 2%). With the realized rates kept every step (calls 4-6) the share still ranged 0.54-0.93 over six runs: the
batch's phase moves the plan either way (docs/speculative.md, session 38), and the sampling was not shown to be the
cause; the comparator is kept whole all the same.

Observations that wait (since 2026-12-07, session 40). A settled step's observations change nothing it or the next
held steps read: a held plan and a held admission price nothing. So while the next step holds (`will_hold`), the
pipeline keeps the policy's observations (realized rates, output and step times, calibration) in order in a list and
runs them all at the first step that decides anything (a plan, a priced admission, another load), at an idle engine,
or once max_waiting_observations wait (SpecStepPipeline `_policy_log`). Same updates, same order, read by the same
decisions; only run later, many at once. Why: one step's observations cost ~5 us in a loop that runs them back to
back on this CPU and 10-18 us in an engine step between the model's and the sampler's work (the caches cold for
their code and state), and on the GPU's host about twice that: on an H100 (session 39) the adaptive mode's settled
steps at 16 sequences ran 0.15 ms longer than static k5's (`deferred` +56 us, `slots` +47, `observe` +13), 7% of
their time and all of the mode's deficit there. Measured on an H100 (session 40): no difference at 1-16 sequences,
where the host waits for the device each step and the deferred work ran inside that wait anyway; on this CPU the
`deferred` phase fell 6-13 us a step at 16-64 sequences. The log holds tuples of plain arguments (a closure's cells,
and a step's lists of emitted tokens, tripled the collector's runs at 64 sequences).

Settled runs (since 2026-12-07, session 40; `settled_runs`). After a held plan the steps its plan and admission will
hold for are known: the plan's interval left, the admission hold's, the steps to the next challenge and to the next
exploration (`_start_run`). Those steps run the holds' bookkeeping alone (`_run_admission`, `_run_step`: the plan's
age, the admissions held, the challenge clock, the short chains, the decisions' counts), not their checks, and any
step that leaves the run (another load bucket, an admission not taken) runs the full checks. The state is the
checks' step by step (test). Why: a held step's checks were on the host's path before the step's forward (on the
H100 the adaptive mode's `slots` phase ran 15-23 us a step longer than static k5's at one sequence, where only holds
run); on this CPU the runs took 3.6 us a step off it there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec.step_times import load_bucket

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


class SettledSteps:
    """Methods of SlotPolicy (self is one): the observations' sampling."""

    def settled(self: SlotPolicy) -> bool:
        """Whether the step of the last plan and admission runs as static k's would (module docstring): the plan
        held (a `_plan_age` past 1 is a hold's) a chain measured at its load (where realized rates decide: they
        do but in tests and benchmarks/spec_host.py), and the admission was held."""
        return (self._plan_age > 1 and (self._plan_trusted or not self.realized.decides) and self._admission_held
                and self.chain > 0
                and self.paused == 0 and not (self.explore or self.probe or self.verifying_probe or self.verify_all))

    def observes_step(self: SlotPolicy) -> bool:
        """Whether this step's output processing and step time are kept (its realized rate always is): called once
        an adaptive step, after its admission and plan. Every step's, but one in observe_every of settled ones."""
        if self.observe_every <= 1 or not self.settled():
            self._settled_steps = 0
            return True
        self._settled_steps += 1
        if self._settled_steps % self.observe_every:
            self.num_unobserved += 1
            return False
        return True

    def calibrates(self: SlotPolicy) -> bool:
        """Whether this verification's outcomes go to the calibrator (called once a verification, after its
        admission): every one until the calibrator has counted calibrated_after outcomes, and every probe's; after
        that one in calibrate_stride; of settled steps' (module docstring), one in observe_every more. The
        verification's index decides, never its outcomes (non-anticipating)."""
        self._verifications += 1
        cal = self.calibrator
        if cal is None:
            return False
        if self.verifying_probe:
            return True
        every = self.observe_every if self.observe_every > 1 and self.settled() else 1
        if cal.num_observed >= self.calibrated_after and self.calibrate_stride > 1:
            every *= self.calibrate_stride
        return self._verifications % every == 0

    def _start_run(self: SlotPolicy, bucket: int, decision: str) -> None:
        """After a held plan (and before the next step's admission): how many steps from the next on would hold the
        admission and the plan at this bucket by the full checks, with nothing else to do (`_run_step`,
        `_run_admission`): the plan's interval left, the admission hold's left, the steps to the next challenge and
        to the next exploration (a chain shorter than k). Only where settled. Each is a count of steps the checks
        themselves count down, so the run's steps change the state exactly as those checks would."""
        self._run_left = self._run_admissions = 0
        if not self.settled() or self.hold_after <= 0 or self._all_streaks.get(bucket, 0) < self.hold_after:
            return
        interval = self.plan_interval()
        left = min(interval - self._plan_age, interval - 1 - self._held_admissions)
        if self._challenges_on():
            left = min(left, self._challenge_interval.get(bucket, self.challenge_every)
                       - self._challenge_clock.get(bucket, 0) - 1)
        if self.chain < self.k:
            left = min(left, self.explore_every - self._short_chains - 1)
        if left > 0:
            self._run_left = self._run_admissions = left
            self._run_bucket, self._run_decision = bucket, decision

    def _run_admission(self: SlotPolicy, bucket: int) -> bool:
        """One step of a settled run's admission (`_start_run`): the hold's bookkeeping (`_holds_admission`)."""
        if self._run_admissions <= 0 or bucket != self._run_bucket:
            self._run_left = self._run_admissions = 0
            return False
        self._run_admissions -= 1
        self._held_admissions += 1
        self.num_admission_holds += 1
        self._admitted_any = self._admission_held = True
        return True

    def _run_step(self: SlotPolicy, bucket: int) -> bool:
        """One step of a settled run's plan (`_start_run`): the hold's bookkeeping (plan_drafting's hold,
        `_count_short`, `_challenge_due`), none of their checks."""
        if self._run_left <= 0 or bucket != self._run_bucket or self._run_admissions >= self._run_left:
            self._run_left = self._run_admissions = 0  # (an admission of the run not taken: the full checks)
            return False
        self._run_left -= 1
        self._plan_age += 1
        if self._challenges_on():
            self._challenge_clock[bucket] = self._challenge_clock.get(bucket, 0) + 1
        if self.chain < self.k:
            self._short_chains += 1
        self.decisions[self._run_decision] += 1
        return True

    def will_hold(self: SlotPolicy, num_seqs: int | None = None) -> bool:
        """Whether the next step's admission and plan both hold (`_holds_admission`, `_holds_plan`) at num_seqs
        sampling sequences (None: at the plan's load): the policy is settled, the load is in the plan's bucket, the
        plan is younger than its interval and the admission's hold has steps left. Where True, neither reads an
        observation (the plan's chain is trusted, or realized rates do not decide), so the policy's observations may
        wait (`defers_observations`). Exact, not a guess: the same conditions those holds check, in the state this
        step left (a test checks that no priced admission nor plan ran while observations waited)."""
        if not self.settled() or self.hold_after <= 0 or num_seqs == 0:
            return False
        bucket = self._plan_bucket if num_seqs is None else load_bucket(num_seqs)
        interval = self.plan_interval()
        return (self._holds_at(bucket) and self._plan_age < interval
                and self._all_streaks.get(self._hold_bucket(bucket), 0) >= self.hold_after
                and self._held_admissions < interval - 1)

    def _holds_at(self: SlotPolicy, bucket: int) -> bool:
        """Whether a held plan holds at this load bucket: its own, or a lower one (hold_falls)."""
        return bucket == self._plan_bucket or (self.hold_falls and 0 < bucket < self._plan_bucket)

    def still_holds(self: SlotPolicy, num_seqs: int) -> bool:
        """`will_hold(num_seqs)` where `will_hold()` was True after the last decisions and none has been made since
        (the pipeline's case when observations waited at the last wait for the device: between it and the next
        step's admission only observations are kept, and those change none of will_hold's inputs): the load's
        bucket is one the plan holds at. The cheaper check, made every held step."""
        return num_seqs > 0 and self._holds_at(load_bucket(num_seqs))

    def defers_observations(self: SlotPolicy, pending: int) -> bool:
        """Whether the policy's observations of past steps (`pending` of them waiting) may wait past this wait for
        the device: the next step holds (`will_hold`) and fewer than max_waiting_observations wait (module
        docstring, "Observations that wait"). Within a settled run (`_run_left` steps left after this step's plan)
        the next step holds by the run's own construction, so will_hold's checks are skipped: `_start_run` took the
        run's length as the fewest steps left of the plan's interval, of the admission hold's and before the next
        challenge or exploration, the run's steps keep those counts as the checks would (`_run_step`,
        `_run_admission`), and a step that leaves the run sets `_run_left` to 0 (a test asserts will_hold wherever
        a run has steps left). ~3 us a step on this CPU, every settled step."""
        if pending >= self.max_waiting_observations:
            return False
        return self._run_left > 0 or self.will_hold()
