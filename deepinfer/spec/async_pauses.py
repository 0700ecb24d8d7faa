"""The plain steps of an adaptive drafting pause, through async scheduling.

Why. A speculative engine's steps run sync (spec/pipeline.py): the host waits for each step's draw, verifies,
drafts, then builds the next step. When the confidence scheduler pauses drafting (spec/slot_policy.py: SlotPolicy,
32 to 1024 plain steps), those steps would gain nothing from the spec path, yet still ran sync, while the engine
without speculation runs async scheduling (sched/step_pipeline.py: step N + 1's host work overlaps step N's device
work). On the H200 (2026-12-03) the adaptive engine's plain steps cost about twice an off step (docs/speculative.md,
"On the H200"), so the adaptive mode stayed below speculation off exactly where it drafted least.

What. `AsyncPauses` owns an ordinary StepPipeline with async scheduling and hands it the steps of a pause that
need nothing of the spec path: `delegable` says when. A step is delegated while
- the pause has more than one step left (the last one runs the spec path: its plan_drafting ends the pause and
  drafts the probe, which needs the step's tokens on the host);
- no draft is held (a held draft is verified by a spec step);
- no running sequence has a grammar (structured requests draft under masks: they stay on the spec path);
- no sequence is part-way through its prompt, and none waits unless the step surely admits none (every running
  slot taken, max_num_seqs, and no sequence can finish before the step is scheduled: the async pipeline will not
  resolve its step in flight first): a prompt chunk needs its MTP pass at once (the MTP KV of a whole prompt is not
  kept for a catch-up), and that pass reads the chunk's next token, which an async step leaves pending on the
  device. So a full batch with a queue behind it still pauses async until a sequence finishes.
Each delegated step counts as one step of the pause (SlotPolicy.plan_drafting, which in a pause only counts down).
When a step cannot be delegated, the step in flight is drained first (its tokens are read and processed), so the
spec path always starts with every token on the host, as it does today.

MTP-KV catch-up. A paused sync step keeps its decode rows' hidden states for the sequence's next MTP pass
(spec/mtp_catchup.py). A delegated step does the same through the model runner's `hidden_tap`, called after its
forward, before its logits, with no host sync: the rows (one per decode: position context_len) are copied on the
device's queue. The token after each kept position is read from the sequence when the catch-up runs, after the
drain, so it is on the host by then; the pending input token of an async step is never needed (only the hidden
state is kept).

Bookkeeping. Sequences finished (EOS, stop, length, failed) or preempted in delegated steps lose their held draft
and kept rows, as on the spec path; every resolved step is recorded in the speculation metrics as a step of
plain decodes (0 drafts verified), and its wall time (from the call that launched it and resolved the one before:
what a pause step costs with the overlap) is observed by the policy as a plain step (and as plain decoding's
realized rate, spec/realized_rates.py), so the drafting plan compares drafting with async plain decoding.

Where. `use_async_pauses` (start-up): adaptive MTP engines, where async scheduling would run by default (not the
CPU), unless async_scheduling=False was asked for; DEEPINFER_SPEC_ASYNC_PAUSES forces it on (also on the CPU:
tests) or off.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from deepinfer import envs
from deepinfer.errors import ConfigError
from deepinfer.sched.request import SeqStatus, Sequence
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.sched.step_pipeline import StepPipeline

if TYPE_CHECKING:
    from deepinfer.spec.pipeline import SpecStepPipeline

# why a step of a pause ran the spec path (AsyncPauses.sync_steps' keys)
LAST = "last"  # the pause's last step: it ends the pause and drafts the probe
DRAFTS = "drafts"  # a draft is held for the step
GRAMMAR = "grammar"  # a running sequence has a grammar
PROMPT = "prompt"  # a sequence waits (and may be admitted), or is part-way through its prompt


def use_async_pauses(cfg, backend, kv, method: str) -> bool:
    """Whether an engine's adaptive pauses run async (module docstring); ConfigError where
    DEEPINFER_SPEC_ASYNC_PAUSES=1 asks for it on an adaptive engine that cannot."""
    if not cfg.speculative_adaptive:
        return False  # no pauses: nothing to run async
    var = envs.SPEC_ASYNC_PAUSES
    want = var.get()
    reasons = []
    if method != "mtp":
        reasons.append(f"speculative_method={method!r} (its drafts are proposed from the host's tokens every step)")
    if kv.uses_state:
        reasons.append("the model keeps per-sequence state (V4): its steps run sync")
    if cfg.async_scheduling is False:
        reasons.append("async_scheduling=False (--no-async-scheduling / DEEPINFER_ASYNC_SCHEDULING=0)")
    if want and reasons:
        raise ConfigError(f"{var.name}=1: an adaptive engine's pauses cannot run async here: " + "; ".join(reasons))
    if want is None:  # use_async_scheduling's rule with the field unset: where the device runs apart from the host
        want = backend.device.type != "cpu"
    return bool(want) and not reasons


class AsyncPauses:
    """The delegated steps of adaptive pauses: an async StepPipeline over the spec pipeline's scheduler, runner and
    output processor, keeping that pipeline's book (its policy, metrics, DraftBook and PausedRows, read from it at
    each use)."""

    def __init__(self, spec: SpecStepPipeline):
        self.spec = spec
        self.inner = StepPipeline(spec.scheduler, spec.runner, spec.output_processor, async_scheduling=True)
        self.num_steps = 0  # delegated steps launched (engine life)
        self.num_drains = 0  # times a step in flight was resolved to hand the next step to the spec path
        self.sync_steps: dict[str, int] = {LAST: 0, DRAFTS: 0, GRAMMAR: 0, PROMPT: 0}  # pause steps kept sync, why
        # the running sequences were all checked (no grammar, none part-way through its prompt) since the last step
        # of the spec path: delegated steps admit no sequence and a running one stays a decode, so the check holds
        # until the spec path runs again (it may admit). At 256 sequences the per-sequence check every step cost
        # ~0.2 ms of host time a step here, part of why a paused cell ran 0.72x of off on the H200 (8cd3124).
        self._running_checked = False
        # (pause key, answer) of PausedRows.all_finish_within for the pause's rows: a sequence's tokens left and
        # the pause's steps left both fall by one a step, so the answer holds for a whole pause (key below)
        self._finish_answer: tuple[tuple[int, int], bool] | None = None

    def has_pending(self) -> bool:
        return self.inner.has_pending()

    def delegable(self) -> bool:
        """Whether the next step runs here (module docstring); a pause step that cannot is counted by reason."""
        if self.spec.policy.paused <= 0:
            return False
        why = self._sync_reason()
        if why is None:
            return True
        self.sync_steps[why] += 1
        return False

    def _sync_reason(self) -> str | None:
        if self.spec.policy.paused == 1:
            return LAST
        if self.spec.book.drafts:
            return DRAFTS
        if self.spec.scheduler.waiting and not self._admits_none():
            return PROMPT
        if self._running_checked:
            return None
        for seq in self.spec.scheduler.running:
            if seq.grammar is not None:
                return GRAMMAR
            if seq.num_uncomputed_tokens > 1:
                return PROMPT
        self._running_checked = True
        return None

    def _admits_none(self) -> bool:
        """Whether the next step surely admits no waiting sequence: every running slot is taken, and no running
        sequence can finish before the step is scheduled (the async pipeline schedules before it resolves the step
        in flight, unless it must resolve first)."""
        sched = self.spec.scheduler
        if len(sched.running) < sched.max_running:
            return False
        return not self.inner.has_pending() or not self.inner.must_resolve_first()

    def step(self) -> list[Sequence]:
        """One delegated call: launch the next step (a pause step: counted down), resolve the one in flight."""
        t0 = time.perf_counter()
        resolves = self.inner.has_pending()
        self.spec.runner.hidden_tap = self._tap
        try:
            got = self.inner.step()
        finally:
            self.spec.runner.hidden_tap = None
        t_inner = time.perf_counter()
        launched = self.inner.pending
        if launched is not None:
            self.num_steps += 1
            self.spec.policy.plan_drafting(len(launched.sampling))  # in a pause of > 1 step left: counts down, drafts 0
            for seq in launched.sched.preempted:
                self.spec.book.discard(seq)
                self.spec.paused_rows.drop(seq)
        self._resolved(got)
        self.spec._steady_chain = 0  # (RealizedRates.step: a delegated step drafts nothing)
        if resolves and launched is not None:  # a steady-state call: one step launched, one resolved
            scheduled = launched.sched.scheduled
            dt = self.spec.times.agree([time.perf_counter() - t0])[0]  # (tp rank 0's, spec/shared_times.py)
            self.spec.policy.observe_step(dt, len(scheduled), len(scheduled))  # (decodes only: one token each)
            self.spec.policy.realized.step(len(scheduled), 0, 0, False, len(scheduled), dt)
        else:
            self.spec.policy.realized.tick()
        # (spec/step_phases.py: the inner async step whole as "launch", this wrapper's bookkeeping as "observe")
        self.spec.phases.add("async_pause", {"launch": t_inner - t0, "observe": time.perf_counter() - t_inner},
                             len(launched.sched.scheduled) if launched is not None else 0)
        return got

    def drain(self) -> list[Sequence]:
        """Resolve the step in flight, if any (before a spec step, or when the engine drains)."""
        self._running_checked = False  # the spec path runs next (it may admit)
        if not self.inner.has_pending():
            return []
        self.num_drains += 1
        got = self.inner.drain()
        self._resolved(got)
        return got

    def _resolved(self, got: list[Sequence]) -> None:
        """After a step resolved: its decodes in the metrics (as a spec step with no draft records them), and the
        finished sequences' drafts and kept rows dropped."""
        n = len(got)
        done = SeqStatus.FINISHED  # (the status compared inline: the per-sequence property calls cost ~40 us a step
        for seq in [s for s in got if s.status is done]:  # at 256 sequences on this CPU, in every pause step)
            n -= seq.finish_reason == "error"
            self.spec.book.discard(seq)
            self.spec.paused_rows.drop(seq)
        if n:
            self.spec.metrics.record_plain(n)

    def _tap(self, sched: SchedulerOutput, batch, hidden: torch.Tensor) -> None:
        """ModelRunner.hidden_tap of a delegated step: keep its decode rows (by sequence and position) for the
        MTP-KV catch-up, as a paused spec step keeps them (spec/pipeline.py _draft_next). A row that is not a
        decode cannot occur here (delegable); its sequence's kept rows would no longer be contiguous, so they go."""
        paused = self.spec.paused_rows
        steps = self.spec.policy.paused
        if not paused.worth_keeping(len(sched.scheduled), steps):
            return  # dropped before the pause ends (PausedRows.worth_keeping); the next kept rows start afresh
        # constant through a pause: each delegated step counts one down, one up
        key = (self.spec.policy.num_pauses, steps + self.num_steps)
        if self._finish_answer is None or self._finish_answer[0] != key:
            self._finish_answer = (key, paused.all_finish_within((it.seq for it in sched.scheduled), steps,
                                                                 self.spec.scheduler.kv.max_model_len))
        if self._finish_answer[1]:
            return  # read by no pass (PausedRows.all_finish_within)
        rows: list[tuple[Sequence, int, int]] = []
        r = 0
        for item, q in zip(sched.scheduled, batch.query_lens_cpu):
            seq, c = item.seq, item.context_len
            if q == 1 and not item.draft and c + 1 == seq.num_tokens:  # a decode that samples (ScheduledSeq.samples)
                rows.append((seq, r, c))
            else:
                paused.drop(seq)
            r += q
        paused.keep(rows, hidden)
