"""Overlapped output: a one-sync speculative step's read-back left in flight across engine calls, so that the host's
text work runs while the device runs the next step.

Why. Speculative steps run sync (spec/pipeline.py): the host waits for each step's read-back, processes its output,
schedules and launches the next step. Output processing is mostly text: each emitted token goes through the
incremental detokenizer (two tokenizer decodes, ~2-3 us a token), and the engine then builds the request outputs
and the server streams them. On an H100 (2026-12-06, session 33's sweep, embedded model) a k = 5 one-sync step at
256 sequences spent 2.97 of its 8.64 ms in output processing while its device work waited on the host. Without
speculation, async scheduling (sched/step_pipeline.py) already hides that work behind the next step.

What. A one-sync step (spec/one_sync.py) is launched (`OneSyncStep.launch`: the forward, the draw, verification,
the MTP pass and the chain, and the read-back's copy queued) and the call returns; the next engine call first
resolves it (`_resolve`: the one read-back, the emitted tokens, rollback, the book of next drafts, and the token
level of output processing: ids, logprobs, EOS / stop tokens / max_tokens / max_model_len), then schedules and
launches the next step exactly as the sync engine would (nothing is in flight by then: the scheduler sees every
token, every finish and every freed block), and only then makes the resolved step's text (`_flush_texts`:
`OutputProcessor.flush_text`) and runs the deferred bookkeeping, while the device runs the new step. The call
returns the resolved step's sequences; the engine builds their outputs, and the caller streams them, also while
the device works. So a step's outputs come one engine call after its launch (as with async scheduling), and every
token, logprob, text and finish reason is the sync engine's: the same steps run with the same inputs.

What stays on the host's critical path: the read-back wait, the token level of output processing, the schedule,
the draft slots, the batch build and the launches. A sequence with stop strings has its text made at once (a stop
string can end it, which the next schedule must know); its text is not overlapped.

Steps that take the host path (a prompt chunk, a probe, a grammar, a pause's catch-up) resolve in their own call,
as before (their text first flushes any text the sequence has queued, in token order). Failures: a sequence whose
detokenizer raises in `_flush_texts` (spec/step_outputs.py) fails its request (as in `_process`), its blocks freed at once; if it is in the
step in flight, that step's rows of it are dropped when it resolves (a finished sequence takes no tokens), and what
the step wrote into its freed blocks is overwritten by any later user of them (one stream: the later step runs
after it), as sched/step_pipeline.py argues for async scheduling. An abort between the calls is the same.

Where: `DEEPINFER_SPEC_OVERLAP_OUTPUT` (default on) on engines whose steps run one-sync; off, a one-sync step's
read-back is waited for in its own call (the deferred bookkeeping runs during that wait, as before).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.spec.one_sync import OneSyncPlan, PendingRead
    from deepinfer.spec.pipeline import SpecStepPipeline



@dataclass
class StepRecord:
    """A speculative step between its launch and its output processing (SpecStepPipeline._begin / _end)."""

    sched: SchedulerOutput
    conf: dict[int, list[float]]  # confidences of the verified drafts, by index into sched.scheduled
    t_start: float  # perf_counter at the step's schedule
    t0: float  # after the schedule
    t_slots: float  # after the draft slots and the chain plan
    wait0: float  # OneSyncStep.wait_seconds before the step
    t1: float = 0.0  # its tokens on the host: output processing starts
    emitted: list[list[int]] = field(default_factory=list)  # by index into sched.scheduled
    logprobs: list = field(default_factory=list)
    # an overlapped one-sync step: its launched read-back, plan, sampling rows and when the launch ended
    pending: PendingRead | None = None
    plan: OneSyncPlan | None = None
    sampling: list[int] = field(default_factory=list)
    t_launched: float = 0.0
    launch_s: float = 0.0  # the verification, pass and chain's launches (part of the drafting time)
    # a chained step (spec/chained_steps.py): per sequence the tokens its worst case covers (the step before it keeps
    # them at its rollback), and its per-step pipeline fields while the step before resolves
    keep: dict[str, int] = field(default_factory=dict)
    fields: dict | None = None


class OverlappedSteps:
    """Methods of SpecStepPipeline (self is one): resolving an overlapped step, and the deferred text."""

    def _resolve(self: SpecStepPipeline, keep: dict[str, int] | None = None) -> list[Sequence]:
        """The step left in flight by the last call: its read-back, emitted tokens, drafts, and output processing
        with the text deferred (module docstring). keep: tokens the rollback keeps per sequence (a chained step
        launched after this one writes there: spec/chained_steps.py)."""
        rec, self._in_flight = self._in_flight, None
        t0 = time.perf_counter()
        res = self.one_sync.collect(rec.pending)
        self._one_sync_done(rec, rec.plan, rec.sampling, res)
        rec.t1 = now = time.perf_counter()
        self._draft_s = rec.launch_s + (now - t0)  # (the host's share: the launches, the wait and the unpacking)
        self.num_overlapped_steps += 1
        return self._end(rec, keep)
