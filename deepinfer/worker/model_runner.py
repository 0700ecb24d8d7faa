"""Runs a scheduled step on the device: build the batch, forward (a captured graph where the
backend's graph runner can; a step with prompt chunks of few tokens, such as a prefix hit's suffix, as
one decode row per token through the decode graphs: worker/decode_rows.py), logits for the rows that
sample, and the draw; the host reads the drawn ids later (`PendingStep.resolve`), so async
scheduling can queue the next step first.

One request's failure never fails the others (`ModelRunner._sample`): when the sampler raises for
a batch, its rows are sampled one at a time to find those that raise on their own; they draw no
token and are reported in `PendingStep.failed` (the step pipeline finishes their requests with
finish_reason "error"), and the other rows are sampled again as one batch (the sampler is
row-wise and its draw keyed by (seed, position), so they get the tokens the full batch would have
given them). A failure that no single row reproduces, and any failure of the batch build or the
model forward, is not one request's: it raises out of launch() as before.

Structured output (sample/grammar/): rows of sequences with a grammar get a bitmask filled on the
host by their matchers and applied on the device before the draw. The mask for a row needs the
sequence's previous token on the host. When that token is still pending (async scheduling: it is
drawn by the step in flight), launch() queues the forward and stops there (`PendingStep.deferred`);
the pipeline resolves the step in flight (its tokens feed the matchers) while the device runs this
forward, then calls `finish_sampling`, which fills the masks and queues the draw. So a constrained
row is never sampled without its mask, and the host's mask work overlaps the forward. A row whose
grammar state is in error or allows nothing is failed like a row whose sampling raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from deepinfer.backend import Backend, ForwardBatch, GraphRunner, KVCaches, KVLayout
from deepinfer.errors import BackendError, DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.outputs import Logprob
from deepinfer.sample.sampler import DeviceSample, Sampler, SamplingRow
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.worker.batch_builder import BatchBuilder
from deepinfer.worker.decode_rows import ShortExtends
from deepinfer.worker.step_timer import StepTimer
from deepinfer.worker.transfer import HostCopy, tensor_to

logger = logging.getLogger("deepinfer")

_MAX_ERROR_CHARS = 300  # of the exception's text in a request's error message


def request_error(request_id: str, stage: str, exc: BaseException) -> str:
    """The one-line error a request failed by an internal error carries (RequestOutput.error):
    the request id, the stage and the exception's type and text, never a traceback (that is
    logged, with the request id, where the exception is caught)."""
    text = " ".join(str(exc).split())
    if len(text) > _MAX_ERROR_CHARS:
        text = text[:_MAX_ERROR_CHARS] + "..."
    head = f"internal error in request {request_id!r} while {stage}: {type(exc).__name__}"
    return f"{head}: {text}" if text else head


@dataclass
class StepResult:
    """The token drawn for each scheduled sequence that samples this step (None for mid-prompt chunks)."""

    token_ids: list[int | None]
    logprobs: list[dict[int, Logprob] | None]


@dataclass
class PendingStep:
    """A launched step whose draw is still on (or on its way from) the device.

    Every sequence that samples in it holds one pending token (Sequence.num_pending) until
    resolve() reads the ids; resolve() clears those placeholders and returns the ids, and the
    caller appends them (output processing). Nothing here waits for the device except resolve().
    """

    sched: SchedulerOutput
    sampling: list[int]  # indices into sched.scheduled of the sequences that sample (row j of the draw)
    sample: DeviceSample | None = None
    # indices into sched.scheduled of sequences whose sampling raised -> request_error(...): they
    # drew no token (no pending placeholder); the pipeline fails their requests
    failed: dict[int, str] = field(default_factory=dict)
    host: HostCopy | None = None
    resolved: bool = False
    # (logits, rows) of a draw that waits for grammar masks (finish_sampling queues it), else None
    deferred: tuple[torch.Tensor, list[SamplingRow]] | None = None
    timer: StepTimer | None = None  # times the host's wait for the draw (benchmarks)

    def resolve(self) -> StepResult:
        if self.resolved:
            raise DeepInferError("a pending step was resolved twice")
        if self.deferred is not None:
            raise DeepInferError("a step whose draw waits for grammar masks was resolved before finish_sampling")
        self.resolved = True
        n = len(self.sched.scheduled)
        token_ids: list[int | None] = [None] * n
        logprobs: list[dict[int, Logprob] | None] = [None] * n
        if self.sample is None:
            return StepResult(token_ids, logprobs)
        host = self.host.wait() if self.timer is None else self.timer.wait(self.host.wait)
        out = self.sample.output(host)
        items = self.sched.scheduled
        for j, i in enumerate(self.sampling):
            items[i].seq.num_pending -= 1
            token_ids[i] = out.token_ids[j]
            logprobs[i] = out.logprobs[j]
        return StepResult(token_ids, logprobs)


class ModelRunner:
    def __init__(
        self,
        model,
        kv: KVCacheManager,
        num_blocks: dict[str, int],
        max_num_seqs: int,
        device: torch.device,
        sampler: Sampler,
        layouts: dict[str, KVLayout] | None = None,
    ):
        self.model = model
        self.kv = kv
        self.device = device
        self.caches = KVCaches.allocate(kv.specs, num_blocks, kv.block_size, max_num_seqs, device, layouts)
        self.builder = BatchBuilder(kv, device)
        kv.use_backend(getattr(model, "backend", None))  # the KV tiers copy blocks through it (kv/tier_copies.py)
        self.sampler = sampler
        self.graph_runner: GraphRunner | None = None  # decode-graph replay, from the backend
        self.graph_rows = 0  # rows the captured decode graphs cover (0: none)
        # steps with prompt chunks of few tokens replay the decode graphs as decode rows (worker/decode_rows.py);
        # its max_tokens is set at start-up (engine: short_extend_tokens), 0 until then
        self.short_extends = ShortExtends()
        # ids drawn by the last launched step, on the device: a pending token's input id (async)
        self._last_tokens: torch.Tensor | None = None
        self.timer: StepTimer | None = None  # per-phase device timing of launched steps (benchmarks)
        # structured output: the tokenizer facts and the ids no grammar may allow (set by the engine)
        self.grammar_facts = None
        self.grammar_forbidden: torch.Tensor | None = None
        self.num_deferred_draws = 0  # draws that waited for grammar masks after the step in flight resolved
        # a context-parallel replica's step (parallel/cp_forward.ContextParallelForward; set by the engine's
        # parallel set-up): it splits long prefills over the cp ranks and returns the logits rows' hidden states
        self.context_parallel = None
        # called with (sched, batch, hidden) after each launched step's forward, before its logits: the step's final
        # hidden states, still on the device's queue (a tap must not read them on the host). None (the default): no
        # call. Speculative decoding's async pauses set it while they run, to keep the decode rows for the MTP-KV
        # catch-up (spec/async_pauses.py); not called on the context-parallel path (speculation runs in one process)
        self.hidden_tap: Callable[[SchedulerOutput, ForwardBatch, torch.Tensor], None] | None = None

    def capture_decode_graphs(self, backend: Backend, max_model_len: int, max_num_seqs: int,
                              enforce_eager: bool) -> None:
        """Install the backend's decode-graph runner when it captures graphs and enforce_eager is off."""
        if enforce_eager or not backend.caps.graph_capture:
            return
        runner = backend.make_graph_runner(self.model, self.caches, self.kv.block_size, max_model_len, max_num_seqs)
        if runner is None:
            raise BackendError(f"backend {backend.name!r} declares graph_capture but make_graph_runner returned "
                               "no graph runner; run with enforce_eager=True or fix the backend")
        self.graph_runner = runner
        self.graph_rows = max_num_seqs  # the rows of the largest captured bucket

    def reset_state_rows(self, batch: ForwardBatch) -> None:
        """Sequences starting from token 0 get zeroed per-sequence state (a reused row holds old data)."""
        if not self.caches.state:
            return
        fresh = [s for s, c in zip(batch.state_slots_cpu, batch.context_lens_cpu) if c == 0 and s >= 0]
        if not fresh:
            return
        rows = tensor_to(fresh, torch.int64, self.device)
        for t in self.caches.state.values():
            t.index_fill_(0, rows, 0)

    # ------------------------------------------------------------ forward

    def run_model(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states for every token; replays a captured graph when the backend's runner can."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.run(batch)
        return self.model.forward(batch, self.caches)

    def _forward_logits(self, batch: ForwardBatch, timer: StepTimer | None = None,
                        sched: SchedulerOutput | None = None) -> torch.Tensor | None:
        self.reset_state_rows(batch)
        if self.context_parallel is not None:
            rows = self.context_parallel.logits_hidden(batch, self.caches, self.run_model)
            if timer is not None:
                timer.mark("forward")
            return None if rows is None else self.model.compute_logits(rows).float()
        flat = self.short_extends.flatten(batch, self.graph_runner)  # a short extend as decode rows, graphed
        hidden = self.run_model(batch) if flat is None else self.graph_runner.run(flat)
        if self.hidden_tap is not None and sched is not None:
            self.hidden_tap(sched, batch, hidden)
        if timer is not None:
            timer.mark("forward")
        if batch.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    def plan_snapshots(self, sched: SchedulerOutput) -> None:
        """Prefix caching on V4: where this step's compressors save their rings (the block boundaries it crosses,
        kv/state_snapshots.py); every path that runs a step's forward calls it (this one's launch, the speculative
        step's, spec/pipeline.py).

        It also binds this engine's snapshot store (None without prefix caching) to the model, every step: the
        store lives on the model (use_state_snapshots), and a model shared by engines run in turn
        (DeepInferenceEngine.from_components; the CPU speculation benchmark shares one) would otherwise save this
        engine's rings into the store of the engine built last. Found on a trained V4 (session 37): a prefix hit
        restored rings the model had written into the other engine's store, the next tokens differed from an
        engine with its own model, and with n-gram drafts (rings k positions longer) the save raised."""
        if hasattr(self.model, "use_state_snapshots") and getattr(self.model, "state_snapshots", None) is not \
                self.kv.snapshots:
            self.model.use_state_snapshots(self.kv.snapshots)
        if self.kv.snapshots is not None:
            self.kv.snapshots.plan = self.kv.snapshot_plan(sched.scheduled)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queue the step's forward and draw on the device and the copy of the drawn ids to the
        host; never waits for the device. Each sampling sequence gets one pending token."""
        timer = self.timer
        if timer is not None:
            timer.begin()
        self.kv.fence_tier_copies()  # the KV tiers' copies of this step's blocks: a device-side wait, no host sync
        batch, sampling = self.builder.build(sched, self._last_tokens)
        self.plan_snapshots(sched)
        if timer is not None:
            timer.mark("inputs")
        logits = self._forward_logits(batch, timer, sched)
        step = PendingStep(sched, sampling, timer=timer)
        if timer is not None:
            timer.mark("logits")
        if logits is None:
            if timer is not None:
                timer.mark("end")
            return step
        rows = []
        items = sched.scheduled
        for i in sampling:
            seq = items[i].seq
            req = seq.request
            n = seq.num_tokens  # the drawn token's position (pending tokens included)
            rows.append(SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids, seq.seed, n,
                                    num_outputs=n - len(req.prompt_token_ids)))
        if any(items[i].seq.grammar is not None and items[i].seq.num_pending for i in sampling):
            step.deferred = (logits, rows)  # masks need the step in flight's tokens: finish_sampling
            return step
        self._launch_draw(step, logits, rows)
        return step

    @torch.inference_mode()
    def finish_sampling(self, step: PendingStep) -> None:
        """Fill the grammar masks of a deferred step (the step before it is resolved) and queue its draw."""
        if step.deferred is None:
            return
        logits, rows = step.deferred
        step.deferred = None
        self.num_deferred_draws += 1
        self._launch_draw(step, logits, rows)

    def _grammar_mask(self, step: PendingStep):
        """(GrammarMask or None, {index into sched.scheduled: error}) for the step's constrained rows."""
        from deepinfer.sample.grammar.bitmask import fill_grammar_mask

        items = step.sched.scheduled
        states = [(j, items[i].seq.grammar, items[i].seq.output_token_ids, items[i].seq.finished)
                  for j, i in enumerate(step.sampling) if items[i].seq.grammar is not None]
        if not states:
            return None, {}
        mask, failed = fill_grammar_mask(states, self.grammar_facts, self.grammar_forbidden)
        return mask, {step.sampling[j]: message for j, message in failed.items()}

    def _launch_draw(self, step: PendingStep, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """Grammar masks, the draw, the copy of the ids to the host; each drawn sequence gets a pending token."""
        timer = step.timer
        items = step.sched.scheduled
        sampling = step.sampling
        grammar, grammar_failed = self._grammar_mask(step)
        if grammar_failed:  # these rows cannot be sampled: failed, left out of the draw
            for i, message in grammar_failed.items():
                logger.error("request %r: %s", items[i].seq.request.request_id, message)
            keep = [j for j, i in enumerate(sampling) if i not in grammar_failed]
            grammar = grammar.select(keep) if grammar is not None else None
            idx = tensor_to(keep, torch.int64, logits.device)
            logits, rows, sampling = logits.index_select(0, idx), [rows[j] for j in keep], [sampling[j] for j in keep]
        if rows:
            step.sample, step.sampling, step.failed = self._sample(logits, rows, sampling, items, grammar)
        else:
            step.sample, step.sampling = None, []
        step.failed.update(grammar_failed)
        if step.sample is None:  # every sampling row failed
            if timer is not None:
                timer.mark("end")
            return
        step.host = HostCopy(step.sample.tensors, self.device)
        if timer is not None:
            timer.mark("end")
        self._last_tokens = step.sample.token_ids
        sampling = step.sampling
        for j, i in enumerate(sampling):
            seq = items[i].seq
            seq.num_pending += 1
            seq.pending_row = j

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], grammar) -> DeviceSample:
        """The sampler's draw; the grammar mask is passed only when there is one (a sampler without
        structured output support, such as a test double, keeps its two-argument sample())."""
        if grammar is None:
            return self.sampler.sample(logits, rows)
        return self.sampler.sample(logits, rows, grammar)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], sampling: list[int], items, grammar=None
                ) -> tuple[DeviceSample | None, list[int], dict[int, str]]:
        """(draw, the sampling indices it covers, failed index -> error): the whole batch when the
        sampler takes it; otherwise the rows that raise alone are left out (module docstring).

        Only host-side exceptions can be isolated this way: the sampler queues device work without
        waiting for it, so a device fault would surface later, at the host copy, for everyone."""
        try:
            return self._draw(logits, rows, grammar), sampling, {}
        except Exception as exc:  # noqa: BLE001 - re-raised below unless a row alone reproduces it
            batch_exc = exc
        failed: dict[int, str] = {}
        for j, row in enumerate(rows):
            try:
                self._draw(logits[j : j + 1], [row], grammar.select([j]) if grammar is not None else None)
            except Exception as exc:  # this row's own failure
                rid = items[sampling[j]].seq.request.request_id
                logger.exception("request %r: sampling its row raised; the request fails, the others go on", rid)
                failed[sampling[j]] = request_error(rid, "sampling", exc)
        if not failed:
            raise batch_exc  # the batch fails but no row alone does: not one request's failure
        keep = [j for j, i in enumerate(sampling) if i not in failed]
        if not keep:
            return None, [], failed
        idx = tensor_to(keep, torch.int64, logits.device)
        sample = self._draw(logits.index_select(0, idx), [rows[j] for j in keep],
                            grammar.select(keep) if grammar is not None else None)
        return sample, [sampling[j] for j in keep], failed
