"""Runs a scheduled step on the device: build the batch, forward (a captured graph where the
backend's graph runner can), logits for the rows that sample, and the draw; the host reads the
drawn ids later (`PendingStep.resolve`), so async scheduling can queue the next step first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import Backend, ForwardBatch, GraphRunner, KVCaches, KVLayout
from deepinfer.errors import BackendError, DeepInferError
from deepinfer.kv.manager import KVCacheManager
from deepinfer.outputs import Logprob
from deepinfer.sample.sampler import DeviceSample, Sampler, SamplingRow
from deepinfer.sched.scheduler import SchedulerOutput
from deepinfer.worker.batch_builder import BatchBuilder
from deepinfer.worker.step_timer import StepTimer
from deepinfer.worker.transfer import HostCopy, tensor_to


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
    sampling: list[int]  # indices into sched.scheduled of the sequences that sample
    sample: DeviceSample | None = None
    host: HostCopy | None = None
    resolved: bool = False
    timer: StepTimer | None = None  # times the host's wait for the draw (benchmarks)

    def resolve(self) -> StepResult:
        if self.resolved:
            raise DeepInferError("a pending step was resolved twice")
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
        self.sampler = sampler
        self.graph_runner: GraphRunner | None = None  # decode-graph replay, from the backend
        # ids drawn by the last launched step, on the device: a pending token's input id (async)
        self._last_tokens: torch.Tensor | None = None
        self.timer: StepTimer | None = None  # per-phase device timing of launched steps (benchmarks)

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

    def _forward_logits(self, batch: ForwardBatch, timer: StepTimer | None = None) -> torch.Tensor | None:
        self.reset_state_rows(batch)
        hidden = self.run_model(batch)
        if timer is not None:
            timer.mark("forward")
        if batch.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[batch.logits_indices]).float()

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput) -> PendingStep:
        """Queue the step's forward and draw on the device and the copy of the drawn ids to the
        host; never waits for the device. Each sampling sequence gets one pending token."""
        timer = self.timer
        if timer is not None:
            timer.begin()
        batch, sampling = self.builder.build(sched, self._last_tokens)
        if timer is not None:
            timer.mark("inputs")
        logits = self._forward_logits(batch, timer)
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
        step.sample = self.sampler.sample(logits, rows)
        step.host = HostCopy(step.sample.tensors, self.device)
        if timer is not None:
            timer.mark("end")
        self._last_tokens = step.sample.token_ids
        for j, i in enumerate(sampling):
            seq = items[i].seq
            seq.num_pending += 1
            seq.pending_row = j
        return step
