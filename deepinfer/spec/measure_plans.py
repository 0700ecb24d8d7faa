"""The adaptive plan's measuring plans (spec/slot_policy.py's SlotPolicy inherits them): a load not measured yet
(`_measuring`), a load come back to with nothing trusted at it (`_visits_unmeasured`), a pause that checks the model
(`_checks_pause`), and the re-measure after a pause (`_start_remeasure`). Apart from slot_policy.py only to keep each
file to one concern, as spec/chain_plan.py is; they read and set the policy's own fields (measure_steps,
measure_visits, realized, step_times, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec.step_times import PLAIN, SPECULATIVE, load_bucket

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


class MeasurePlans:
    """Methods of SlotPolicy (self is one): when a plan measures rather than models."""

    def _checks_pause(self: SlotPolicy, bucket: int) -> bool:
        """Whether the pause the plan just chose is a check (a short pause measuring plain decoding) rather than a
        pause of the load's backoff: the plan had no gain measured against plain decoding at this load (the model
        alone, or chains measured only against each other, `_anchored`), its best chain's gain was within the
        model's error of plain decoding (at least 1 / model_error), and fewer than max_checks checks ran at this
        load. Why: on the H200 (2026-12-05, session 22, c38b16e) the model priced the best chain at 0.86x plain
        decoding at 64 sequences and 0.68x at 256, where the realized rates by the run's end read a chain of 5 at
        1.46x and 1.27x plain; the 32-step pauses those plans started were a third of the runs' steps there."""
        return (self.draft_cost is not None and self.realized.decides and self.model_error > 1.0
                and not self._plan_measured and self._plan_gain * self.model_error >= 1.0
                and self._checked.get(bucket, 0) < self.max_checks)

    def _start_remeasure(self: SlotPolicy, bucket: int) -> None:
        """A pause at this load ends: its drafting measures are forgotten (RealizedRates.forget_drafting), and the
        chain that measured best before (else k) drafts for the steps a fresh measure takes, so the plan after it
        compares measures again. Where the plan were the model's alone, a model that prices drafting below plain
        decoding would keep the load paused for good: on the H200 (2026-12-04, 951726e) the adaptive mode paused
        through whole runs at 64 and 256 sequences, where static k = 3 ran 1.12x and 1.01x of speculation off."""
        gains = self.realized.gains(bucket, self.k)
        self._remeasure(bucket, max(gains, key=lambda c: (gains[c], -c)) if gains else self.k, 1)
        self.realized.forget_drafting(bucket)

    def _remeasure(self: SlotPolicy, bucket: int, chain: int, extra: int = 0) -> None:
        """The next plans at this load draft `chain` for the steps a realized rate takes to be trusted (warm_steps +
        min_count, and `extra` more): after a pause (`_start_remeasure`) and on a visit (`_visits_unmeasured`)."""
        self._remeasure_chain, self._remeasure_bucket = chain, bucket
        self._remeasure_left = self.realized.warm_steps + self.realized.min_count + extra

    def _visits_unmeasured(self: SlotPolicy, num_seqs: int, bucket: int) -> bool:
        """Whether this plan is the first at a load bucket since plans at another (a visit), where no chain's realized
        rate is trusted (RealizedRates.steps_near): then chains of k draft until one is, and the plan after prices
        the chains by them (with paired tokens, every shorter chain's tokens too) rather than by the model alone.
        Why: on an H100 (2026-12-07, session 39) the first cell at one sequence came after the benchmark's warm-up
        (4 steps there, not trusted) and the model, whose calibrated survival put a chain of 5 at 4.0 tokens a step
        where its steps emitted 6, planned chains of 4 for 64-72 steps until a challenge measured 5: 0.74-0.88 of
        static k5's tok/s a user in that repeat, over three runs. measure_visits False, or measure_steps 0 (no
        measuring plans at all): off (benchmarks.speculative adaptive_novisit, the A/B)."""
        return (self.measure_visits and self.measure_steps > 0 and self.draft_cost is not None
                and self.realized.decides and self._last_plan[0] != bucket and not self.realized.steps_near(num_seqs))

    def _measuring(self: SlotPolicy, num_seqs: int, kind: str = SPECULATIVE) -> bool:
        """Whether this plan measures its load (class docstring). Speculative: none of its speculative steps seen there
        yet, and fewer than measure_steps measuring plans made there (a load whose speculative steps are never
        observed, e.g. all off the one-sync path, is modelled after those). Plain: none of its plain steps seen, and
        fewer than two measuring pauses there. On the H200 (2026-12-04, fc4c856) an engine that measured speculative
        steps at every load and never paused priced plain steps by the speculative steps' excess (12.9 ms at 256
        sequences, where an off step took ~1.7) and drafted at every load, at 0.88x of off at 64 and 256."""
        if self.measure_steps <= 0 or self.step_times.seen(kind, num_seqs):
            return False
        if kind == PLAIN and self.step_times.neighbour_ratio(PLAIN, num_seqs) is not None:
            return False  # priced by the next bucket's plain steps (StepTimeRatios.neighbour_ratio): no pause
        key = (kind, load_bucket(num_seqs))
        n = self._measured.get(key, 0)
        if n >= (self.measure_steps if kind == SPECULATIVE else 2):
            return False
        self._measured[key] = n + 1
        return True
