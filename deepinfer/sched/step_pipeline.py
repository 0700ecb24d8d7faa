"""One engine step: schedule -> launch -> resolve -> output processing, optionally pipelined.

Sync mode: each step is launched and resolved in the same call (the host waits for the
device's draw, then processes it).

Async mode (async scheduling, as vLLM's --async-scheduling): a call schedules and launches
step N+1 first, then resolves step N and processes its tokens while the device runs N+1, so
a decode step costs about max(host, device) instead of host + device. Outputs come one call
late; a call with nothing left to schedule only resolves (the final call drains).

How step N+1 can be scheduled before step N's tokens are known: every sequence that samples
in N holds one pending token (Sequence.num_pending, counted in num_tokens), so the scheduler
places its next decode at the right position, and the model runner takes that input id from
step N's device tensor (a device-side gather), never from the host.

What this costs, and why it is safe:
- A sequence that finishes in step N (EOS, stop string, ...) may already be in step N+1. Its
  N+1 token is dropped when N+1 resolves: never appended, never output. Its blocks are freed
  when N resolves, before N+1 has run. That is safe because all device work is ordered on one
  stream: N+1's KV write into those blocks is queued before anything a later step schedules
  there (a new prefill reusing them is launched after this point, so it runs after N+1 and
  overwrites what N+1 wrote), and nothing reads a freed block's contents for the dropped
  token. The block tables each step reads are copies taken at launch.
- Sequences whose pending tokens already reach max_tokens / max_model_len are not scheduled
  again (Scheduler._tokens_for): they finish whatever those tokens are.

Per step, the pipeline falls back to resolving the step in flight BEFORE scheduling (no
overlap for that step, same results) when the next step needs the host to know the last
token:
- a running sequence with repetition / frequency / presence penalties (the sampler counts
  the output ids on the host);
- the scheduler would have to preempt (Scheduler.would_preempt): sync mode would have freed
  the blocks of sequences finishing in step N first, so preemption is decided after that.
Logprobs need no fallback (they are computed on the device and copied with the ids). Grammar
masks (structured output) need none either: their step's forward is launched, the draw waits
(PendingStep.deferred) until the step in flight is resolved and its tokens feed the matchers,
then `ModelRunner.finish_sampling` fills the masks and queues the draw, while the forward runs.
Models with per-sequence state (V4) and backends without graph capture run sync (the engine
picks the mode: EngineConfig.async_scheduling).

Failure isolation: an exception in one request's own work fails that request only, in both modes:
- sampling: the runner leaves the rows whose sampling raises out of the draw and reports them
  (PendingStep.failed, worker/model_runner.py); right after the launch, before anything else is
  scheduled, their requests are failed;
- output processing: an exception from OutputProcessor.append_token (detokenizer, stop checker)
  for one sequence fails that sequence's request.
Failing a request (`_fail`) finishes every unfinished sequence of it with finish_reason "error"
(OutputProcessor.fail, which records the message for RequestOutput.error) and frees its blocks at
once, exactly as a stop does (a token of it still in flight is dropped when that step resolves);
the traceback is logged with the request id. The failed sequence is returned with those that got
a token, so the engine reports its request in the same call. Anything else raising in a step (the
scheduler, the batch build, the model forward, a device fault) is not one request's failure: it
raises out of step() as before, and the caller (the HTTP server) fails every request in flight.
"""

from __future__ import annotations

import logging
from typing import Callable

from deepinfer.errors import DeepInferError
from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import Scheduler
from deepinfer.text.output_processor import OutputProcessor
from deepinfer.worker.model_runner import ModelRunner, PendingStep, request_error

logger = logging.getLogger("deepinfer")


class StepPipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, output_processor: OutputProcessor,
                 async_scheduling: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.output_processor = output_processor
        self.async_scheduling = async_scheduling
        self.pending: PendingStep | None = None
        self.num_sync_fallbacks = 0  # async steps that had to resolve before scheduling
        # data-parallel replicas under expert parallelism (deepinfer/parallel/forward_sync.py): (has work ->
        # does any replica have work?) and the dummy forward run when only the others do
        self.forward_sync: Callable[[bool], bool] | None = None
        self.dummy_forward: Callable[[], None] | None = None
        self.num_dummy_forwards = 0

    def has_pending(self) -> bool:
        return self.pending is not None

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token in the step resolved by this call
        (batch order; a sequence finished by it has status FINISHED and holds no blocks), and
        those failed in this call (finish_reason "error", see the module docstring)."""
        prev, self.pending = self.pending, None
        done: list[Sequence] = []
        if prev is not None and self.must_resolve_first():
            self.num_sync_fallbacks += 1
            done = self._process(prev)
            prev = None
        sched = self.scheduler.schedule()
        launched = None
        if self.forward_sync is not None and self.forward_sync(not sched.empty) and sched.empty:
            self.dummy_forward()  # another replica runs a forward: meet its collectives
            self.num_dummy_forwards += 1
        if not sched.empty:
            launched = self.runner.launch(sched)
            self.scheduler.advance(sched)  # its KV is written before any later step reads it (stream order)
            if launched.deferred is None:
                self._fail_rows(launched, done)
        elif prev is None and not done and self.scheduler.has_unfinished():
            raise DeepInferError(
                f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                f"{len(self.scheduler.running)} running sequences (KV cache or token budget too small)"
            )
        if prev is not None:
            done += self._process(prev)
        if launched is not None and launched.deferred is not None:  # grammar masks need prev's tokens
            self.runner.finish_sampling(launched)
            self._fail_rows(launched, done)
        if launched is not None:
            if self.async_scheduling:
                self.pending = launched
            else:
                done += self._process(launched)
        return done

    def _fail_rows(self, launched: PendingStep, done: list[Sequence]) -> None:
        """Rows whose sampling (or grammar mask) failed drew nothing: fail their requests now."""
        for i, message in launched.failed.items():
            seq = launched.sched.scheduled[i].seq
            if not seq.finished:
                self._fail(seq, message)
                done.append(seq)

    def drain(self) -> list[Sequence]:
        """Resolve the step in flight, if any."""
        prev, self.pending = self.pending, None
        return self._process(prev) if prev is not None else []

    def must_resolve_first(self) -> bool:
        """Whether the next step must resolve the step in flight before scheduling (module docstring)."""
        for seq in self.scheduler.running:
            if seq.num_pending and seq.request.needs_host_tokens:
                return True
        return self.scheduler.would_preempt()

    def _process(self, step: PendingStep) -> list[Sequence]:
        """Read the step's ids and run output processing (stop checks, detokenizer, ...)."""
        result = step.resolve()
        append_token = self.output_processor.append_token
        remove = self.scheduler.remove
        got: list[Sequence] = []
        for item, token, logprobs in zip(step.sched.scheduled, result.token_ids, result.logprobs):
            if token is None:
                continue
            seq = item.seq
            if seq.finished:  # finished, aborted or failed after this step was launched: its token is dropped
                continue
            try:
                append_token(seq, token, logprobs)
            except Exception as exc:  # this sequence's own failure fails its request only
                rid = seq.request.request_id
                logger.exception("request %r: processing its output raised; the request fails, the others go on", rid)
                self._fail(seq, request_error(rid, "processing its output", exc))
                got.append(seq)
                continue
            if seq.finished:
                remove(seq)
            got.append(seq)
        return got

    def _fail(self, seq: Sequence, message: str) -> None:
        """Fail seq's request: seq and every unfinished sibling finish with "error", blocks freed."""
        for s in seq.request.seqs:
            if s is seq or not s.finished:
                self.output_processor.fail(s, message)
                self.scheduler.remove(s)
