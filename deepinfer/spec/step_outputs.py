"""A speculative step's outputs on the host (spec/pipeline.py's SpecStepPipeline inherits it): output processing of
its emitted tokens (their text now, or queued for `_flush_texts` while the device runs the next step:
spec/overlap.py), the failures of one request's own work, the rollback of rejected KV (kept where a chained step in
flight writes: spec/chained_steps.py), the prefix cache's keys, and the book of next drafts. Apart from the
pipeline's step only to keep each file to one concern; it reads and sets the pipeline's own fields."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.spec.ngram import NgramDrafter
from deepinfer.worker.model_runner import request_error

if TYPE_CHECKING:
    from deepinfer.spec.pipeline import SpecStepPipeline

logger = logging.getLogger("deepinfer")


class StepOutputs:
    """Methods of SpecStepPipeline (self is one): a step's outputs on the host."""

    def _process(self: SpecStepPipeline, sched: SchedulerOutput, emitted: list[list[int]], logprobs,
                 defer_text: bool = False, keep: dict[str, int] | None = None) -> list[Sequence]:
        """Output processing of a step's emitted tokens (defer_text: their text queued, spec/overlap.py), rollback of
        the rejected KV (none below keep[seq_id]: a chained step in flight writes there), the prefix cache's keys and
        the book of next drafts. Sets `step_ended`: whether a request ended in it (finished or failed; the adaptive
        policy's realized rates leave such a step out, RealizedRates.step)."""
        append_token = self.output_processor.append_token
        kv = self.scheduler.kv
        got: list[Sequence] = []
        self.step_ended = bool(self._failed)
        for i, message in self._failed.items():  # a grammar state in error: its request fails (bitmask.py)
            seq = sched.scheduled[i].seq
            if not seq.finished:
                logger.error("request %r: %s", seq.request.request_id, message)
                for s in seq.request.seqs:
                    if s is seq or not s.finished:
                        self.book.discard(s)
                        self.output_processor.fail(s, message)
                        self.scheduler.remove(s)
                got.append(seq)
        for item, toks, lps in zip(sched.scheduled, emitted, logprobs):
            seq = item.seq
            if not toks or seq.finished:
                continue
            try:
                for j, t in enumerate(toks):
                    append_token(seq, t, lps[j] if lps is not None else None, defer_text)
                    if seq.finished:  # EOS, a stop string or max_tokens mid-draft: the rest is dropped
                        break
                self._extra_tokens += j
            except Exception as exc:  # this sequence's own failure fails its request only
                rid = seq.request.request_id
                logger.exception("request %r: processing its output raised; the request fails, the others go on", rid)
                for s in seq.request.seqs:
                    if s is seq or not s.finished:
                        self.output_processor.fail(s, request_error(rid, "processing its output", exc))
                        self.scheduler.remove(s)
                got.append(seq)
                self.step_ended = True
                continue
            if seq.finished:
                self.step_ended = True
                self.book.discard(seq)
                self.paused_rows.drop(seq)
                self.scheduler.remove(seq)
            got.append(seq)
        for item in sched.scheduled:  # rejected KV back to the pool; keyed only now, verified tokens only
            seq = item.seq
            if seq.finished:
                continue
            kv.rollback(seq, max(seq.num_computed_tokens, keep.get(seq.seq_id, 0)) if keep else seq.num_computed_tokens)
            kv.register_computed(seq)
            kv.trim(seq)
        if isinstance(self.drafter, NgramDrafter) and self._drafting:
            t0 = time.perf_counter()
            for seq in got:
                if not seq.finished:
                    p = self.drafter.propose(seq.prompt_token_ids + seq.output_token_ids, self.policy.k)
                    self._next_drafts.append((seq, p.tokens, p.confidence))
            self._draft_s = time.perf_counter() - t0  # (observed at the step's end, `_step`)
        for seq, toks, conf in self._next_drafts:
            self.book.put(seq, toks, conf)
        self._next_drafts = []
        return got

    def _flush_texts(self: SpecStepPipeline, seqs: list[Sequence]) -> None:
        """The text deferred by `_process(defer_text=True)` (OutputProcessor.flush_text) of these sequences; one
        whose detokenizer raises fails its request, the others go on."""
        flush = self.output_processor.flush_text
        for seq in seqs:
            if not seq.pending_text:
                continue
            try:
                flush(seq)
            except Exception as exc:  # this sequence's own failure fails its request only
                rid = seq.request.request_id
                logger.exception("request %r: processing its output raised; the request fails, the others go on", rid)
                for s in seq.request.seqs:
                    if s is seq or not s.finished:
                        s.pending_text = []
                        self.output_processor.fail(s, request_error(rid, "processing its output", exc))
                        self.book.discard(s)
                        self.paused_rows.drop(s)
                        self.scheduler.remove(s)
