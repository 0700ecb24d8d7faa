"""The adaptive plan's challenges: a chain about as good as the planned one by the plan's own gains is drafted for a
few steps now and then, so that its realized rate is measured afresh next to the planned chain's
(SlotPolicy.plan_drafting; spec/slot_policy.py inherits this).

Why. The plan takes a chain's realized rate where one is measured (spec/realized_rates.py) and the model's gain,
scaled by its error at the nearest measure, where none is (spec/chain_plan.py). Once a chain is planned, only it
runs, so only its measure is refreshed; another chain's stays as it was taken, and one never measured at the load
is judged by the model alone. On H100s (2026-12-06, session 27):
- at one sequence chain 5 was measured over 11 steps at a noisy moment (3,806 tok/s against chain 3's 3,904 over
  86) and the plan drafted chains of 3 through the whole cell: 1.71x of speculation off where static k5 ran 2.01x;
- at 4 sequences only chain 5 was ever measured (no pause there, so no plain measure; one chain alone orders
  nothing) and the model's choice, 5, held for every plan, where static k3 ran 1.27-1.43x of off and k5
  1.19-1.24x in the same calls.
What a bandit does against such lock-in, done here plainly: once every challenge_every drafting steps at a load,
a chain whose gain is within challenge_margin of the planned one's (measured or modelled, as the plan priced it),
or a neighbour of it not measured there, is drafted for challenge_steps steps, the fewest-measured first; its old measure at the load is dropped first, so
the plan after the challenge compares two measures of the last few dozen steps. A challenge that leaves the plan's
chain as it was doubles the load's interval (up to max_challenge_every); one that changes it resets the interval.

Cost: at most challenge_steps of challenge_every drafting steps run a chain the plan did not choose, and only one
within challenge_margin of it by the plan's own estimate. Non-anticipating: every input is a past measure.

Reach (since 2026-12-07, session 41; SlotPolicy.bound_challenges). A chain shorter than the planned one drafts a
prefix of its chain, so the planned chain's own steps say how many tokens it would have emitted on them (paired
tokens, spec/realized_rates.py); what a challenge of it can still find out is its step time alone. That time is
bounded: a shorter chain drafts fewer links and verifies fewer slots, which the model prices (its step seconds per
chain, corrected by the measured step times), and the model's error is bounded by model_error. So where the shorter
chain, with its step shorter than the planned chain's measured step by model_error x the model's saving, still
emits fewer tokens a second than the planned chain measured, its challenge cannot be won but by noise, and is not
run. Why: at one sequence on the embedded model every draft is accepted, so a chain of 4 emits 5 tokens where 5
emits 6 for ~0.07 ms less of a ~1.4 ms step; on H100s (session 40) each 88-step cell there ran 8 challenge steps of
chains of 4 (~1.5% of the cell), and a challenge measured in a fast stretch of the machine won and drafted chains
of 3-4 for 56-63 steps (0.76 of static k5 in that repeat).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


class ChainChallenge:
    """Methods of SlotPolicy (self is one): when a challenge is due, which chain, and its bookkeeping."""

    def _challenges_on(self: SlotPolicy) -> bool:
        """Whether challenges run at all (their clock counts): an interval set, a drafting table, deciding rates."""
        return self.challenge_every > 0 and self.draft_cost is not None and self.realized.decides

    def _challenge_due(self: SlotPolicy, bucket: int) -> bool:
        """Count one drafting step at this load bucket; True once the bucket's interval has passed."""
        if not self._challenges_on():
            return False
        n = self._challenge_clock.get(bucket, 0) + 1
        self._challenge_clock[bucket] = n
        return n >= self._challenge_interval.get(bucket, self.challenge_every)

    def _challenger(self: SlotPolicy, num_seqs: int, current: int) -> int:
        """The chain to challenge `current` with at num_seqs sequences (0: none): among chains 1..k whose gain in
        the last plan (`_plan_gains`) is at least current's / (1 + challenge_margin), and current's neighbours (one
        shorter, one longer) not measured at this load whatever the model says of them, the one with the fewest
        fresh realized steps at this load, ties the higher gain, then the shorter. The neighbours: where the model's
        shape is wrong it may price every other chain outside the margin, and a rate that rises then falls in the
        chain's length is climbed a neighbour at a time (a challenge that wins moves the plan, whose own neighbours
        come next). A neighbour shorter than the longest chain with paired counts at this load is not challenged for
        being unmeasured where the plan's model takes its tokens from paired counts (paired_model): they are counted
        on that chain's steps (`_paired_tokens`), only its step time is the model's, and it is challenged only where
        that prices it within the margin."""
        gains = self._plan_gains
        if current <= 0 or current >= len(gains) or gains[current] <= 0:
            return 0
        floor = gains[current] / (1.0 + self.challenge_margin)
        steps = self.realized.steps_near(num_seqs)
        paired = self.realized.paired_near(num_seqs) if self.paired_model in ("current", "longest") else None
        counted = len(paired) - 1 if paired is not None else 0  # chains whose tokens the plan has from a longer one's
        rivals = [c for c in range(1, len(gains))
                  if c != current and (gains[c] >= floor or (abs(c - current) == 1 and c not in steps
                                                             and c > counted))]
        if rivals and rivals[0] < current and self.bound_challenges:
            rivals = self._within_reach(num_seqs, current, rivals)
        if not rivals:
            return 0
        return min(rivals, key=lambda c: (steps.get(c, 0), -gains[c], c))

    def _within_reach(self: SlotPolicy, num_seqs: int, current: int, rivals: list[int]) -> list[int]:
        """The rivals less the shorter chains out of reach of `current` (module docstring, "Reach"): on current's
        steady steps at this load, a shorter chain c would have emitted paired[c] tokens (RealizedRates
        paired_with_seconds, counted on those same steps) where current emitted paired[current] in s seconds; c's
        step saves at most model_error x the model's saving (the last plan's modelled seconds of current less c's).
        Where even that step's rate, paired[c] / (s - model_error x saving), is below current's measured one,
        paired[current] / s, c cannot win the challenge on anything but noise and is left out. Past measures only."""
        got = self.realized.paired_with_seconds(num_seqs, current)
        secs = self._plan_seconds
        if got is None or len(secs) <= current:
            return rivals
        paired, s = got
        if len(paired) <= current or paired[current] <= 0.0 or s <= 0.0:
            return rivals
        rate = paired[current] / s
        kept = []
        for c in rivals:
            if c < current:
                fastest = s - self.model_error * max(secs[current] - secs[c], 0.0)
                if fastest > 0.0 and paired[c] / fastest < rate:
                    self.num_challenges_bounded += 1
                    continue
            kept.append(c)
        return kept

    def _start_challenge(self: SlotPolicy, num_seqs: int, bucket: int, current: int) -> int:
        """The chain this plan drafts: a challenger when one is due and found (its challenge then runs
        challenge_steps steps, this one the first), else `current`."""
        if not self._challenge_due(bucket):
            return current
        self._challenge_clock[bucket] = 0
        rival = self._challenger(num_seqs, current)
        if not rival:
            return current
        self.realized.forget_chain(num_seqs, rival)
        self._challenge_left, self._challenge_chain = max(self.challenge_steps - 1, 0), rival
        self._challenge_bucket, self._challenged_from = bucket, current
        self.num_challenges += 1
        return rival

    def _end_challenge(self: SlotPolicy, bucket: int, chosen: int) -> None:
        """The plan after a challenge chose `chosen` at `bucket`: the challenged bucket's interval doubles where the
        plan's chain stayed, and starts over where the challenge changed it; a plan at another load (the load moved
        during the challenge) decides nothing of it and the interval stays."""
        if not self._challenged_from:
            return
        if bucket != self._challenge_bucket:
            self._challenged_from = self._challenge_left = 0
            return
        if chosen == self._challenged_from:
            interval = self._challenge_interval.get(bucket, self.challenge_every)
            self._challenge_interval[bucket] = min(2 * interval, self.max_challenge_every)
        else:
            self._challenge_interval[bucket] = self.challenge_every
            self.num_challenges_won += 1
        self._challenged_from = 0
