"""The adaptive policy's observations of a step's time (spec/slot_policy.py's SlotPolicy inherits them): its output
processing per emitted token (`observe_output`) and its wall time against the tables' price (`observe_step`), the
corrections its plans price steps by (spec/step_times.py). Apart from slot_policy.py only to keep each file to one
concern, as spec/settled_steps.py (which of these a step keeps) is; it reads and sets the policy's own fields
(adaptive, cost, draft_cost, step_times, token_seconds)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from deepinfer.spec.step_times import PLAIN, SPECULATIVE, load_bucket

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


class StepObservations:
    """Methods of SlotPolicy (self is one): a step's time observed."""

    def observe_output(self: SlotPolicy, seconds: float, tokens: int, num_seqs: int) -> None:
        """One step's output processing: `seconds` of host time for `tokens` emitted tokens of num_seqs sequences."""
        if tokens > 0:
            x, b = seconds / tokens, load_bucket(num_seqs)
            old = self.token_seconds.get(b)
            self.token_seconds[b] = x if old is None else 0.9 * old + 0.1 * x

    def observe_step(self: SlotPolicy, seconds: float, num_tokens: int, num_seqs: int, drafted_seqs: int = 0, chain: int = 0,
                     verified: bool = False, off_path: bool = False, emitted: int | None = None) -> None:
        """A decode-row step's wall time (schedule to output processing) of num_seqs sequences against what the
        tables predict for it: the step table at its tokens, plus the drafting table for what it drafted. The tables
        time the forward and the drafter alone, over no context; the engine's steps also pay the sampler,
        verification, output processing, batch building and attention over real contexts, and that excess depends
        on the load and on the kind of step (spec/step_times.py has the H200 numbers), so the correction is kept
        per kind and per load bucket. Past steps only: non-anticipating.

        Only the two steady states are observed: a plain step (nothing verified, nothing drafted) and a speculative
        one (verified and drafted). A step that verified and drafted nothing (the last before a pause: a probe's
        verification) or drafted without verifying (the first after a prompt or a pause) is a transition, priced
        by neither steady state; on the H200 (2026-12-04, 8734169) three such probe verifications (host path, two
        waits) at 4.6x their price were all the speculative side ever saw at one sequence, and kept every later
        plan paused (tau 1.04) where static k = 5 ran 2.12x. off_path: a speculative step that took the host path
        (two waits) where the steady state runs one-sync (spec/one_sync.py); not observed either: on the H200
        (2026-12-04, fd509cb) the one speculative step seen at one sequence ran 2.25 ms, x2.86 its price, where the
        one-sync k = 5 steps ran ~1.8 ms, x1.8.

        emitted: the tokens the step emitted (default num_seqs: a plain step's one each). Their output processing
        (token_seconds each, measured) is taken out of the step's time before it is compared with the tables: it is
        paid once per token however the token is emitted, so it is no cost of speculation, and left in, it made a
        speculative step's ratio (~5 tokens a sequence) price a longer chain by the ratio of a shorter one (x4.9 at 64
        sequences in benchmarks/spec_policy_sim.py, where k = 3 was planned and k = 5 ran 1.17x faster). Plans
        compare time per token without it (its share is the same for every choice)."""
        if not self.adaptive or self.draft_cost is None or self.cost is None or num_tokens <= 0:
            return
        if verified != bool(drafted_seqs and chain) or (verified and off_path):
            return
        out = self.token_seconds.get(load_bucket(num_seqs), 0.0) * (num_seqs if emitted is None else emitted)
        seconds = max(seconds - out, 0.1 * seconds)
        predicted = self.cost.at(num_tokens)
        drafting = self.drafting_seconds(drafted_seqs, chain) if drafted_seqs and chain else 0.0
        kind = SPECULATIVE if verified else PLAIN
        self.step_times.observe(kind, num_seqs, seconds, predicted + drafting, drafting)
