"""The drafting half of a speculative step (spec/pipeline.py's SpecStepPipeline inherits it): the drafts for the
next step, made after this step's verification. On the host path: the MTP pass over the rows whose next token is
known, then the chain, as long as the policy planned and each sequence's KV room allows (`_draft_next`); on the
one-sync path the step's device work already drafted, and `_book_one_sync` books what it made. Either way the
drafting time feeds the policy (`_time_drafting`). Apart from the pipeline's verification and output processing
only to keep each file to one concern; it reads and sets the pipeline's own fields (policy, drafter, book of next
drafts, kept rows)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.spec.draft_slots import cover_tokens
from deepinfer.spec.grammar_drafts import DraftGrammarMask
from deepinfer.spec.mtp_drafter import MTPDrafter, MTPRows, step_pass_rows

if TYPE_CHECKING:
    from deepinfer.spec.pipeline import SpecStepPipeline


class NextDrafts:
    """Methods of SpecStepPipeline (self is one): the next step's drafts."""

    def _book_one_sync(self: SpecStepPipeline, sched: SchedulerOutput, res) -> None:
        """A one-sync step's drafts (spec/one_sync.py): every sequence drafted, its chain as long as its room let."""
        chain_len = self._chain_plan  # planned before the step (_step), what it drafted for
        self._drafting = True
        self.metrics.record_chain(chain_len)
        self.drafter.num_graph_passes += 1
        self.drafter.num_graph_chains += 1
        self._drafted = (len(sched.scheduled), max((len(d) for d in res.drafts), default=0))
        self._next_drafts = [(it.seq, d, c) for it, d, c in zip(sched.scheduled, res.drafts, res.confidence)]

    def _draft_next(self: SpecStepPipeline, sched: SchedulerOutput, hidden: torch.Tensor, emitted: list[list[int]],
                    batch) -> None:
        """The MTP pass over the rows whose next token is known, then the chain; drafts go to the book. The policy
        plans the chain (spec/slot_policy.py: 0 in an adaptive pause; a probe drafts for probe_seqs sequences);
        decode rows that get no pass are kept for their sequence's next one (spec/mtp_catchup.py)."""
        self._next_drafts = []
        samplers = sum(1 for it, toks in zip(sched.scheduled, emitted) if it.samples and toks)
        if self._chain_plan is None:  # not planned before the step (_step)
            t0 = time.perf_counter()
            self._chain_plan = self.policy.plan_drafting(samplers)
            self.policy_seconds += time.perf_counter() - t0
        chain_len = self._chain_plan
        self._drafting = chain_len > 0
        if not isinstance(self.drafter, MTPDrafter):
            return  # n-gram drafts are proposed after output processing, from the tokens then known
        t0 = time.perf_counter()
        model = self.runner.model
        if hasattr(model, "mtp_input"):  # (V4: the pass reads the residual streams, not the final state)
            hidden = model.mtp_input(hidden)
        # a model with per-sequence state (V4) keeps no rows for later: its MTP rings must advance in position order
        # with the prefix cache's snapshots taken as the main layers' were, in the step that crosses the boundary
        keep_rows = not self.scheduler.kv.uses_state
        limit = self.policy.probe_seqs if self.policy.adaptive and self.policy.probe else samplers
        rows, seqs = step_pass_rows(sched, emitted, self.scheduler.kv)
        now: list[MTPRows] = []
        now_seqs: list[Sequence] = []
        keep: list[tuple[Sequence, int, int]] = []
        chain: list[int] = []
        drafting: list[Sequence] = []
        drafted_after: list[list[int]] = []  # per drafting sequence: its tokens emitted this step
        for item, row, seq, toks in zip(sched.scheduled, rows, seqs, emitted):
            if row.drafts and chain_len > 0 and len(drafting) < limit:
                chain.append(self._chain_room(seq, self.policy.chain_length(len(drafting))))
                drafting.append(seq)
                drafted_after.append(toks)
            elif keep_rows and row.drafts and item.num_tokens - len(item.draft) == 1:  # a decode left undrafted
                keep.extend((seq, row.start + j, row.context_len + j) for j in range(row.count))
                continue
            else:  # a prompt chunk (or recompute), or a row whose next token is unknown: its pass now, no draft
                self.paused_rows.drop(seq)
                row = MTPRows(row.start, row.count, row.next_ids, row.context_len, False, row.state_row)
            now.append(row)
            now_seqs.append(seq)
        if now:
            rows_before = sum(r.count for r in now)
            merged, now = self.paused_rows.plan(now, now_seqs, hidden)
            self._caught_up = sum(r.count for r in now) > rows_before
            self.runner.builder.sync_tables()
            if chain:
                self.metrics.record_chain(chain_len)
            mask = None
            if DraftGrammarMask.needed(drafting):  # structured requests draft under their grammar
                mask = DraftGrammarMask(drafting, drafted_after, self.runner.grammar_facts,
                                        self.runner.grammar_forbidden, self.runner.sampler)
            drafts = self.drafter.run(merged, now, chain, self.runner.builder.mirror, mask)
            self.num_grammar_masked += mask.num_masked if mask is not None else 0
            self._drafted = (len(drafting), max(chain, default=0))
            self._next_drafts = list(zip(drafting, drafts.tokens, drafts.confidence))
        steps = self.policy.paused + 1
        if keep and self.paused_rows.worth_keeping(len(keep), steps) and not self.paused_rows.all_finish_within(
                (seq for seq, _, _ in keep), steps, self.scheduler.kv.max_model_len):
            self.paused_rows.keep(keep, hidden)
        if hasattr(model, "release_mtp_input"):
            model.release_mtp_input()
        if drafting:
            self._draft_s = time.perf_counter() - t0  # (observed at the step's end, SpecStepPipeline._step)

    def _time_drafting(self: SpecStepPipeline, dt: float) -> None:
        """The admission's drafting cost: a moving average of the measured drafting time per step."""
        self.policy.draft_seconds = dt if self.policy.draft_seconds == 0 else 0.8 * self.policy.draft_seconds + 0.2 * dt

    def _chain_room(self: SpecStepPipeline, seq: Sequence, want: int) -> int:
        """Drafts the sequence can make, at most `want` (the policy's chain length for it): the chain writes MTP KV
        at positions up to num_computed + n - 2, which must be allocated (without preempting anyone) and inside
        max_model_len."""
        kv = self.scheduler.kv
        n = min(want, kv.max_model_len - seq.num_computed_tokens + 1)
        while n > 1 and not cover_tokens(kv, seq, n - 1):
            n -= 1
        return max(n, 0)
