"""A speculative step's verification outcomes on the host (spec/pipeline.py's SpecStepPipeline inherits it): each
sequence's emitted tokens and logprobs (`_emit`), and the metrics and calibration of what was verified, deferred to
the next wait for the device (`_observe`, `_run_deferred`). Apart from the pipeline's step only to keep each file to
one concern; it reads and sets the pipeline's own fields (metrics, policy, deferred work). The adaptive policy's step
observations are deferred the same way (`_observe_policy`)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from deepinfer.spec.realized_rates import RealizedRates

if TYPE_CHECKING:
    from deepinfer.sched.scheduler import SchedulerOutput
    from deepinfer.spec.pipeline import SpecStepPipeline


class VerifyOutcomes:
    """Methods of SpecStepPipeline (self is one): what a verification emitted, and its bookkeeping."""

    def _emit(self: SpecStepPipeline, items, sampling: list[int], out, num_acc: list[int], toks: list[list[int]],
              conf: dict[int, list[float]], emitted: list[list[int]], logprobs: list, k: int) -> None:
        """Each sampling sequence's emitted tokens and logprobs (into emitted / logprobs, by index into items), and
        the metrics and calibration of its verification (k: the most drafts a sequence verified)."""
        r = 0
        decodes: list[int] = []
        any_logprobs = any(x is not None for x in out.logprobs)  # most steps: none asked for, no per-row scan
        for b, i in enumerate(sampling):
            a = num_acc[b]
            emitted[i] = toks[b]
            d = len(items[i].draft)
            if any_logprobs:
                lp = out.logprobs[r : r + a + 1]
                logprobs[i] = lp if any(x is not None for x in lp) else None
            r += d + 1
            if items[i].num_tokens - d == 1:
                decodes.append(b)
        if not k:  # nothing verified: the decodes count as steps of one token
            if decodes:
                self.metrics.record_plain(len(decodes))
        elif decodes:
            self._observe([sampling[b] for b in decodes], items, [num_acc[b] for b in decodes], conf)

    def _observe(self: SpecStepPipeline, idx: list[int], items, num_acc: list[int], conf: dict[int, list[float]]) -> None:
        """Metrics, and the calibrator's outcomes (slot j counts when slots < j were all accepted): deferred to the
        next wait for the device (`_run_deferred`), where the host would idle; the next step's admission then reads
        the calibration of the steps before this one (non-anticipating either way)."""
        verified = [len(items[i].draft) for i in idx]
        self._deferred.append(lambda: self.metrics.record(verified, num_acc, sum(verified)))
        cal = self.policy.calibrator
        if cal is None or not self.policy.calibrates():  # (decided now: the policy's state is this step's)
            return
        rows = [(conf.get(i), v, a) for i, v, a in zip(idx, verified, num_acc)]
        self._policy_log.append((_calibrate, self, cal, rows))  # (the policy's: it may wait, `_run_deferred`)

    def _observe_policy(self: SpecStepPipeline, sched: SchedulerOutput, out_s: float, step_s: float, real_s: float,
                        emitted: int, ended: bool = False, observed: bool = True,
                        lens: bytes | None = None, *, tokens: int, drafts: int) -> None:
        """The adaptive policy's observations of this step: its output processing, its time against the tables
        (decode rows only: what the tables price; a step whose MTP pass caught up a pause's rows paid a one-off pass
        over them, spec/mtp_catchup.py, which is the pause's cost, not the step's; where the steady state runs
        one-sync, a speculative step that took the host path is not one of it) and its realized rate
        (spec/realized_rates.py: this step's chain for every sequence, 0: none, -1: a probe's or an exploration's
        few, or a step some sequence drafted nothing in, against the last step's).

        Their inputs are read now; the policy's updates run at the next wait for the device with the metrics and
        calibration (`_run_deferred`), so a plan reads the observations of the steps before the last one (past
        steps only either way). On the H200 (2026-12-05, session 17) they cost an adaptive one-sync step ~0.03 ms
        after its output processing at one sequence, where the next step's read-back wait was ~0.14 ms.

        ended: a request ended in the step (RealizedRates.step leaves it out of the realized rates).

        lens: how many tokens each scheduled sequence emitted, one byte each (None: not known); on a steady drafting
        step, how many emitted each count goes to the realized rates (the shorter chains' counterfactual tokens,
        RealizedRates "paired").

        observed False: a settled step whose output processing and step time are not kept (spec/settled_steps.py);
        its realized rate is.

        tokens, drafts: the step's forward tokens and drafts summed over its sequences (`step_sizes`)."""
        n = len(sched.scheduled)
        policy = self.policy
        # a prompt chunk: some sequence's rows other than its drafts are not one (each is at least one)
        if self._caught_up or tokens - drafts != n:
            self._steady_chain = -1  # a prompt chunk or a catch-up: no steady step, nor the next one
            self._policy_log.append((_observe_output, policy, observed, out_s, emitted, n))
            return
        verified = drafts > 0
        drafted = self._drafted
        off_path = self.one_sync is not None and not self._one_sync_ran
        now = self._drafted_chain(sched)
        before, self._steady_chain = self._steady_chain, now
        # each sequence's tokens emitted, as bytes (at most k + 1 each; an object the garbage collector does not
        # track): observations that wait keep them, and the step's list of lists kept instead cost 20-30 us a step of
        # collections at 64 sequences on this CPU (benchmarks/spec_host.py: 33 collections a cell against 5)
        lens = lens if lens is not None and now > 0 and before == now and not ended and policy.realized.paired \
            else None
        # (a tuple of the step's numbers, not a closure: a closure's cells are as many objects for the collector)
        log = self._policy_log
        if lens is None:
            log.append((_observe_step, policy, observed, out_s, step_s, real_s, emitted, n, tokens, drafted, verified,
                        off_path, before, now, ended))
            return
        # a steady step (most of a settled run's, observed one in observe_every): its realized rate by the short path
        # (RealizedRates.steady_step), and its times where kept
        if observed:
            log.append((_observe_times, policy, out_s, step_s, emitted, n, tokens, drafted, verified, off_path))
        log.append((RealizedRates.steady_step, policy.realized, n, now, emitted, real_s, lens))

    def _drafted_chain(self: SpecStepPipeline, sched: SchedulerOutput) -> int:
        """The chain this decode-rows step drafted for every live sampling sequence (0: none; -1: some only, or an
        exploration's mixed lengths): RealizedRates.step's `now`."""
        seqs, chain = self._drafted
        if seqs == 0:
            return 0
        if seqs >= len(sched.scheduled):  # (every scheduled sequence drafted: the one-sync step's, no count needed)
            return chain if not self.policy.explore else -1
        live = sum(1 for it in sched.scheduled if it.samples and not it.seq.finished)
        return chain if seqs >= live and not self.policy.explore else -1

    def _run_deferred(self: SpecStepPipeline, fold: bool = False) -> None:
        """Run the bookkeeping `_observe` (and `_observe_policy`) deferred: called while the host waits for the device
        (the one-sync step's read-back, the host path's draw), and when no request is left after a step or an abort
        (`flush_if_idle`, fold: every policy observation too); not when the metrics are read (`stats_fields`).
        On the H200 (2026-12-04, 733f4eb) the adaptive policy's host work was ~540 us a step against static k's ~150,
        most of it in the host-bound steps of few sequences, where the device is idle half the step.
        The policy's observations (`_policy_log`) run with them unless the policy holds its next step
        (SlotPolicy.defers_observations); then they wait for `_fold_policy_log` (spec/settled_steps.py)."""
        t0 = time.perf_counter()
        while self._deferred:
            self._deferred.pop(0)()
        log = self._policy_log
        if log:
            if fold or not self.policy.defers_observations(len(log)):
                self._fold_policy_log(len(log))
            else:
                self._policy_waiting = len(log)  # (these would have run by now: `_fold_unless_holding`)
        self._deferred_s += time.perf_counter() - t0

    def _fold_policy_log(self: SpecStepPipeline, n: int) -> None:
        """Run the policy's first n observations, in order (spec/settled_steps.py "Observations that wait"): each a
        tuple of a function and its arguments."""
        log = self._policy_log
        run, self._policy_log, self._policy_waiting = log[:n], log[n:], 0
        for observe in run:
            observe[0](*observe[1:])

    def _fold_unless_holding(self: SpecStepPipeline, num_seqs: int) -> None:
        """Before a step's admission and plan at num_seqs sampling sequences: the observations that waited run first
        unless both hold (SlotPolicy.still_holds), so that whatever decides reads what it read before they could wait:
        every observation up to the last wait for the device (those of the step just resolved run at this step's)."""
        if self._policy_waiting and not self.policy.still_holds(num_seqs):
            t0 = time.perf_counter()
            self._fold_policy_log(self._policy_waiting)
            self.policy_seconds += time.perf_counter() - t0


def step_sizes(sched: SchedulerOutput) -> tuple[int, int]:
    """A step's forward tokens and drafts, summed over its scheduled sequences (one pass)."""
    tokens = drafts = 0
    for it in sched.scheduled:
        tokens += it.num_tokens
        drafts += len(it.draft)
    return tokens, drafts


# the policy's observations, run from `_policy_log` (module-level functions of plain arguments: see _observe_policy)

def _calibrate(pipe: SpecStepPipeline, cal, rows: list) -> None:
    """A verification's outcomes into the calibrator (rows: each sequence's confidences, verified, accepted)."""
    t0 = time.perf_counter()
    known = [r for r in rows if r[0] is not None]
    if known:
        cal.observe_verified([r[0] for r in known], [r[1] for r in known], [r[2] for r in known])
    pipe.policy_seconds += time.perf_counter() - t0


def _observe_output(policy, observed: bool, out_s: float, emitted: int, n: int) -> None:
    """A step with a prompt chunk or a catch-up: its output processing where kept; it ages the realized rates."""
    if observed:
        policy.observe_output(out_s, emitted, n)
    policy.realized.tick()


def _observe_times(policy, out_s: float, step_s: float, emitted: int, n: int, tokens: int, drafted: tuple[int, int],
                   verified: bool, off_path: bool) -> None:
    """A steady step's output processing and step time (its realized rate: RealizedRates.steady_step)."""
    policy.observe_output(out_s, emitted, n)
    policy.observe_step(step_s, tokens, n, *drafted, verified=verified, off_path=off_path, emitted=emitted)


def _observe_step(policy, observed: bool, out_s: float, step_s: float, real_s: float, emitted: int, n: int,
                  tokens: int, drafted: tuple[int, int], verified: bool, off_path: bool, before: int, now: int,
                  ended: bool) -> None:
    """A decode-rows step that is not a steady one with its emitted counts (those: `_observe_times` and
    RealizedRates.steady_step): its output processing and step time where kept, its realized rate."""
    if observed:
        _observe_times(policy, out_s, step_s, emitted, n, tokens, drafted, verified, off_path)
    policy.realized.step(n, before, now, verified, emitted, real_s, ended=ended)
