"""The adaptive policy's admission (spec/slot_policy.py's SlotPolicy inherits it): which of the held drafts' slots a
step verifies (`counts`), the hold that skips pricing them after a streak of all-verified admissions at a load
(`_holds_admission`), the nearly-free rule, the step's measured fixed seconds the pricing charges, and the moving
averages of the held drafts' confidences the chain plan prices. Apart from slot_policy.py only to keep each file to
one concern, as spec/chain_plan.py is; it reads and sets the policy's own fields (k, calibrator, cost, probe,
verify_all, explore, admit_all_below, hold_after, replan_every, mean_confidence, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from deepinfer.spec.confidence import conf_matrix
from deepinfer.spec.draft_slots import HeldDraft
from deepinfer.spec.scheduler import admit_array, admit_lists
from deepinfer.spec.step_times import PLAIN, SPECULATIVE, load_bucket

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy

# most slots (sequences x k) admitted in plain floats (SlotPolicy.counts); above, numpy (spec/scheduler.py
# admit_array). On this CPU (2026-12-04, k = 5): the plain-float path 37 us at 5 slots, ~5 us more a slot (385 us at
# 80); the numpy path ~130 us at 5-40 slots, ~170 at 80, ~500 at 1,280 (the all-torch one was 610-780 us at any load)
SMALL_ADMISSION = 24


class SlotAdmission:
    """Methods of SlotPolicy (self is one): the verification's admission."""

    def counts(self: SlotPolicy, held: list[HeldDraft], caps: list[int], base_tokens: int, base_yield: int) -> list[int]:
        if not self.adaptive:
            return [min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)]
        bucket = load_bucket(len(held))
        if self._run_admissions and self._run_admission(bucket):  # a settled run (spec/settled_steps.py)
            return [min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)]
        self._admission_held = self._holds_admission(bucket)
        if self._admission_held:
            return [min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)]
        confs = [h.confidence for h in held]
        big = len(held) * self.k > SMALL_ADMISSION
        if big:  # numpy: at 256 sequences the list paths cost ~1 ms of host time a step on the H200's host (fc4c856)
            lens = np.minimum(np.minimum(np.asarray(caps, dtype=np.int64), self.k),
                              np.fromiter(map(len, confs), dtype=np.int64, count=len(confs)))
            lens_list = lens.tolist()
            width = max(lens_list)
            conf = conf_matrix(confs, width)
            if width:
                self._track_confidence_array(conf, lens)
                if self.recent_drafts is not None:
                    self.recent_drafts.add(conf, lens)
        else:
            lens_list = [min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)]
            self._track_confidence(confs, lens_list)
            if self.recent_drafts is not None:
                self.recent_drafts.add(confs, lens_list)
        if self.probe:  # the first sequences in batch order: chosen before any draw, whatever the drafts
            self.probe, self.verifying_probe, self.verify_all = False, True, False
            self._all_streaks.pop(bucket, None)
            return [n if i < self.probe_seqs else 0 for i, n in enumerate(lens_list)]
        if self.verify_all:  # drafted to be measured (plan_drafting): every slot, chosen before any draw
            self.verify_all = False
            self._all_streaks.pop(bucket, None)
            return lens_list
        spec_s = self.draft_seconds if self.draft_cost is None else 0.0
        fixed = self._step_fixed_seconds(len(held))
        if spec_s == 0.0 and self._nearly_free(lens_list, base_tokens, fixed):
            self._admitted_any = True
            self._note_admission(bucket, True)
            return lens_list
        if not big:  # plain floats (admit_lists: the same choice as `admit`), cheaper here
            row = self.calibrator.survival_row
            survival = [row(h.confidence, n) for h, n in zip(held, lens_list)]
            counts = admit_lists(survival, self.cost, base_tokens, float(base_yield), speculation_seconds=spec_s,
                                 draft_seconds=fixed, all_within=self.admit_all_below)
        elif width:
            counts = admit_array(self.calibrator.estimate_array(conf), lens, self.cost, base_tokens,
                                 float(base_yield), draft_seconds=fixed, speculation_seconds=spec_s,
                                 in_unit=True, all_within=self.admit_all_below)[0].tolist()
        else:
            counts = lens_list
        self._admitted_any = any(counts)
        self._note_admission(bucket, counts == lens_list)
        return counts

    def _holds_admission(self: SlotPolicy, bucket: int) -> bool:
        """Whether this admission verifies every held slot unpriced: the last hold_after priced admissions at this
        load (bucket; other loads' admissions between them do not count) verified every held slot, fewer than
        plan_interval() - 1 admissions have been held since the last priced one, and these drafts are neither a
        probe's, a measure's (verified by their own rules) nor an exploration's (drafted so that their deeper slots'
        confidences are seen). Past admissions decide, never
        these drafts or their outcomes (non-anticipating). Why: on the H200 (2026-12-06, session 27's sweep) every
        admission at 4-64 sequences verified every held slot, and pricing them (the confidence matrix, its moving
        averages, the step's fixed seconds, the admission over 80-320 slots) cost 40-130 us of host time a step where
        the one-sync steps wait for the host (the adaptive mode's `slots` phase 0.185 ms a step at 16 sequences,
        static k = 5's 0.051), about what it ran behind static k = 5 there. The hold lasts what the plan holds
        (plan_interval: replan_every, doubling while plans repeat), so the deeper slots' confidences the plan prices are still tracked once a plan."""
        if self.hold_after <= 0 or self.probe or self.verify_all or self.explore:
            return False
        if self._all_streaks.get(self._hold_bucket(bucket), 0) < self.hold_after:
            return False
        if self._held_admissions >= max(self.plan_interval() - 1, 0):
            return False
        self._held_admissions += 1
        self.num_admission_holds += 1
        self._admitted_any = True
        return True

    def _hold_bucket(self: SlotPolicy, bucket: int) -> int:
        """The load bucket whose streak an admission at `bucket` holds by: its own, or while a plan holds through a
        fall in load (SlotPolicy.hold_falls) the plan's."""
        if self.hold_falls and self._plan_age and self.chain > 0 and bucket < self._plan_bucket:
            return self._plan_bucket
        return bucket

    def _note_admission(self: SlotPolicy, bucket: int, verified_all: bool) -> None:
        """A priced admission at `bucket` verified every held slot (or not): the streak `_holds_admission` reads."""
        if verified_all:
            self._all_streaks[bucket] = self._all_streaks.get(bucket, 0) + 1
        else:
            self._all_streaks.pop(bucket, None)
        self._held_admissions = 0

    def _nearly_free(self: SlotPolicy, lens: list[int], base_tokens: int, fixed: float) -> bool:
        """Whether verifying every held slot costs at most admit_all_below of the step's time without them
        (fixed + the table at base_tokens): then the admission verifies them all, without pricing a slot. Why
        that is within admit_all_below of the admission's optimum: all slots yield at least what the best set
        yields, in at most dT more seconds than it takes (the table is non-decreasing), and the best set's step
        takes at least T0, so rate(all) >= rate(best) / (1 + dT / T0). On the H200 (2026-12-05) a step's verified
        tokens were ~2% of its time at 4-64 sequences (the table: 0.23 ms at 4 tokens, 0.28 at 128; a step ~1.3-4
        ms), where the admission cost 60-190 us of host time a step on this CPU and dropped slots worth ~nothing."""
        total = sum(lens)
        if not total or self.admit_all_below <= 0.0:
            return False
        c0 = self.cost.at(base_tokens)
        if self.cost.at(base_tokens + total) - c0 > self.admit_all_below * (c0 + fixed):
            return False
        self.num_admitted_all += 1
        return True

    def _step_fixed_seconds(self: SlotPolicy, num_seqs: int) -> float:
        """Seconds a step of MTP drafting pays whatever the admission verifies: the measured excess of this load's
        steps over the step table (spec/step_times.py: the speculative kind's, else the plain kind's; 0 where
        neither was seen) and the drafting of the next chain. The step table times the forward alone; priced by it,
        a verified slot's marginal cost is its share of a 0.3 ms forward where the H200's steps at 4 sequences ran
        ~2.5 ms (2026-12-04, 373807e), and the admission verified 12 of 20 drafted slots a step, where static k = 5
        verified all and ran 1.34x of speculation off against the adaptive mode's 1.02x. Past steps only."""
        if self.draft_cost is None:
            return 0.0
        over = self.step_times.overhead(SPECULATIVE, num_seqs) if self.step_times.seen(SPECULATIVE, num_seqs) \
            else self.step_times.overhead(PLAIN, num_seqs) if self.step_times.seen(PLAIN, num_seqs) else 0.0
        return max(over or 0.0, 0.0) + self.drafting_seconds(num_seqs, self.chain or self.k)

    def _track_confidence_array(self: SlotPolicy, conf: np.ndarray, lens: np.ndarray) -> None:
        """`_track_confidence` over a [B, W] array, row i's first lens[i] slots held (every column has one): column
        means where every draft is held in full (the usual step), else over the held slots only."""
        if int(lens.min()) >= conf.shape[1]:
            self._track_means((conf.sum(0) / conf.shape[0]).tolist())
            return
        valid = np.arange(conf.shape[1])[None, :] < lens[:, None]
        self._track_means((np.where(valid, conf, 0.0).sum(0) / valid.sum(0)).tolist())

    def _track_confidence(self: SlotPolicy, conf: list[list[float]], lens: list[int]) -> None:
        """Moving average per slot of the held drafts' confidences (conf[i][:lens[i]] valid)."""
        width = max(lens, default=0)
        if width and min(lens) == width:  # every draft held in full (the usual step): column sums, the same order
            self._track_means([sum(col) / len(conf) for col in zip(*(c[:width] for c in conf))])
            return
        means = []
        for j in range(width):
            vals = [c[j] for c, n in zip(conf, lens) if n > j]
            means.append(sum(vals) / len(vals))
        self._track_means(means)

    def _track_means(self: SlotPolicy, means: list[float], decay: float = 0.9) -> None:
        """Fold one step's per-slot mean confidences into mean_confidence (a slot seen first starts at its mean)."""
        for j, m in enumerate(means):
            if j < len(self.mean_confidence):
                self.mean_confidence[j] = decay * self.mean_confidence[j] + (1 - decay) * m
            elif j == len(self.mean_confidence):
                self.mean_confidence.append(m)
