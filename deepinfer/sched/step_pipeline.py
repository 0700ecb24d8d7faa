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
Logprobs need no fallback (they are computed on the device and copied with the ids).
Models with per-sequence state (V4) and backends without graph capture run sync (the engine
picks the mode: EngineConfig.async_scheduling).
"""

from __future__ import annotations

from deepinfer.errors import DeepInferError
from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import Scheduler
from deepinfer.text.output_processor import OutputProcessor
from deepinfer.worker.model_runner import ModelRunner, PendingStep


class StepPipeline:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, output_processor: OutputProcessor,
                 async_scheduling: bool):
        self.scheduler = scheduler
        self.runner = runner
        self.output_processor = output_processor
        self.async_scheduling = async_scheduling
        self.pending: PendingStep | None = None
        self.num_sync_fallbacks = 0  # async steps that had to resolve before scheduling

    def has_pending(self) -> bool:
        return self.pending is not None

    def step(self) -> list[Sequence]:
        """Run one step; returns the sequences that got a token in the step resolved by this call
        (batch order; a sequence finished by it has status FINISHED and holds no blocks)."""
        prev, self.pending = self.pending, None
        done: list[Sequence] = []
        if prev is not None and self._must_resolve_first():
            self.num_sync_fallbacks += 1
            done = self._process(prev)
            prev = None
        sched = self.scheduler.schedule()
        launched = None
        if not sched.empty:
            launched = self.runner.launch(sched)
            self.scheduler.advance(sched)  # its KV is written before any later step reads it (stream order)
        elif prev is None and not done and self.scheduler.has_unfinished():
            raise DeepInferError(
                f"scheduler made no progress with {len(self.scheduler.waiting)} waiting and "
                f"{len(self.scheduler.running)} running sequences (KV cache or token budget too small)"
            )
        if prev is not None:
            done = self._process(prev)
        if launched is not None:
            if self.async_scheduling:
                self.pending = launched
            else:
                done = self._process(launched)
        return done

    def drain(self) -> list[Sequence]:
        """Resolve the step in flight, if any."""
        prev, self.pending = self.pending, None
        return self._process(prev) if prev is not None else []

    def _must_resolve_first(self) -> bool:
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
            if seq.finished:  # finished or aborted after this step was launched: its token is dropped
                continue
            append_token(seq, token, logprobs)
            if seq.finished:
                remove(seq)
            got.append(seq)
        return got
