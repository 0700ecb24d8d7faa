"""Turns a scheduled step into a ForwardBatch, runs the model, and samples.

Batch building (`build_batch`) is kept apart from the forward call (`run_model`)
so a backend can replay captured graphs for decode batches: set
`runner.graph_runner` to an object with `can_run(batch) -> bool` and
`run(batch) -> hidden` (see deepinfer/core/graph_runner.py where a backend has one).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.core.forward_batch import ForwardBatch
from deepinfer.core.kv_caches import KVCaches
from deepinfer.core.kv_manager import KVCacheManager
from deepinfer.core.scheduler import SchedulerOutput
from deepinfer.core.step_timer import StepTimer
from deepinfer.core.transfer import HostCopy, tensor_to, to_device
from deepinfer.errors import DeepInferError
from deepinfer.outputs import Logprob


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
    sample: object | None = None  # sampler.DeviceSample
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


def token_slots(table: torch.Tensor, req_idx: torch.Tensor, positions: torch.Tensor, tokens_per_entry: int,
                block_size: int) -> torch.Tensor:
    """int64 KV slot each token writes: the entry it completes (a compressed group writes one
    entry per tokens_per_entry tokens: -1 for the others), -1 where the table entry is freed."""
    m = tokens_per_entry
    entries = positions if m == 1 else torch.clamp((positions + 1) // m - 1, min=0)
    blocks = table[req_idx, entries // block_size].to(torch.int64)
    slots = blocks * block_size + entries % block_size
    valid = blocks >= 0
    if m > 1:
        valid &= (positions + 1) % m == 0
    return torch.where(valid, slots, torch.full_like(slots, -1))


class ModelRunner:
    def __init__(
        self,
        model,
        kv: KVCacheManager,
        num_blocks: dict[str, int],
        max_num_seqs: int,
        device: torch.device,
        sampler=None,
    ):
        self.model = model
        self.kv = kv
        self.device = device
        self.specs = {s.name: s for s in kv.specs}
        self.block_size = kv.block_size
        self.caches = KVCaches.allocate(kv.specs, num_blocks, kv.block_size, max_num_seqs, device)
        self.sampler = sampler
        self.graph_runner = None  # optional decode-graph replay, installed by a backend-specific runner
        # ids drawn by the last launched step, on the device: a pending token's input id (async)
        self._last_tokens: torch.Tensor | None = None
        self.timer: StepTimer | None = None  # per-phase device timing of launched steps (benchmarks)

    def capture_decode_graphs(self, backend, max_model_len: int, max_num_seqs: int, enforce_eager: bool) -> None:
        """Install decode CUDA-graph replay when the backend can capture and enforce_eager is off."""
        if enforce_eager or not backend.caps.graph_capture:
            return
        from deepinfer.core.graph_runner import CUDAGraphRunner

        self.graph_runner = CUDAGraphRunner.capture(
            self.model, self.caches, self.block_size, max_model_len, max_num_seqs, self.device
        )

    # ------------------------------------------------------------ batch

    def build_batch(self, sched: SchedulerOutput) -> ForwardBatch:
        return self._build(sched)[0]

    def _build(self, sched: SchedulerOutput) -> tuple[ForwardBatch, list[int]]:
        """The batch, and the indices of the scheduled sequences that sample this step.

        A sequence whose last token is still pending (drawn by the step in flight, async
        scheduling) gets a 0 in the host input ids, overwritten on the device by that step's
        drawn id: the host never waits for it.
        """
        items = sched.scheduled
        query_lens: list[int] = []
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        sampling: list[int] = []
        fill_dst: list[int] = []  # input rows whose id is a pending token ...
        fill_src: list[int] = []  # ... and its row in self._last_tokens
        total = 0
        for i, it in enumerate(items):  # one pass; a decode's input is its last output token (no slice)
            seq, c, q = it.seq, it.context_len, it.num_tokens
            out_ids = seq.output_token_ids
            n = seq.num_tokens
            query_lens.append(q)
            ctx_lens.append(c)
            seq_lens.append(c + q)
            if seq.num_pending:
                if seq.num_pending != 1 or c + q != n or self._last_tokens is None:
                    raise DeepInferError(
                        f"{seq.seq_id!r}: {seq.num_pending} pending tokens, scheduled [{c}, {c + q}) of {n}: "
                        "only the last token may be pending, drawn by the last launched step"
                    )
                if q > 1:
                    input_ids.extend(seq.token_ids_slice(c, n - 1))
                input_ids.append(0)
                fill_dst.append(total + q - 1)
                fill_src.append(seq.pending_row)
            elif q == 1 and c == n - 1 and out_ids:
                input_ids.append(out_ids[-1])
            else:
                input_ids.extend(seq.token_ids_slice(c, c + q))
            total += q
            qsl.append(total)
            if c + q == n:  # reaches the last token: samples (ScheduledSeq.samples)
                logits_idx.append(total - 1)
                sampling.append(i)

        ctx_t = torch.tensor(ctx_lens, dtype=torch.int64)
        if len(input_ids) == len(items):  # decode-only: one token per sequence
            req_idx = torch.arange(len(items))
            positions = ctx_t
        else:
            q_t = torch.tensor(query_lens, dtype=torch.int64)
            req_idx = torch.repeat_interleave(torch.arange(len(items)), q_t)
            starts = torch.repeat_interleave(torch.tensor(qsl[:-1], dtype=torch.int64), q_t)
            positions = ctx_t[req_idx] + torch.arange(len(input_ids), dtype=torch.int64) - starts

        bs = self.block_size
        rows = torch.tensor([self.kv.state_slot(it.seq.seq_id) for it in items], dtype=torch.int64)
        block_tables: dict[str, torch.Tensor] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for name, spec in self.specs.items():
            width = max(self.kv.table_len(spec, max(seq_lens, default=0)), 1)  # tables cover seq_lens exactly
            bt = self.kv.tables[name][rows, :width]  # a copy: later steps may change the host buffer
            block_tables[name] = bt
            slot_mapping[name] = token_slots(bt, req_idx, positions, spec.tokens_per_entry, bs)

        dev = self.device
        state_slots_cpu: list[int] = []
        state_slots = None
        if self.kv.uses_state:
            state_slots_cpu = rows.tolist()
            state_slots = to_device(rows.to(torch.int32), dev)

        ids = tensor_to(input_ids, torch.int64, dev)
        if fill_dst:  # device-side: pending tokens' ids from the last step's draw (stream-ordered after it)
            idx = tensor_to([fill_dst, fill_src], torch.int64, dev)
            ids.index_copy_(0, idx[0], self._last_tokens.index_select(0, idx[1]))
        batch = ForwardBatch(
            input_ids=ids,
            positions=to_device(positions, dev),
            query_start_loc=tensor_to(qsl, torch.int32, dev),
            seq_lens=tensor_to(seq_lens, torch.int32, dev),
            context_lens=tensor_to(ctx_lens, torch.int32, dev),
            block_tables={k: to_device(v, dev) for k, v in block_tables.items()},
            slot_mapping={k: to_device(v, dev) for k, v in slot_mapping.items()},
            logits_indices=tensor_to(logits_idx, torch.int64, dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            state_slots=state_slots,
            state_slots_cpu=state_slots_cpu,
            block_size=bs,
        )
        return batch, sampling

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

    @torch.inference_mode()
    def compute_logits(self, sched: SchedulerOutput) -> tuple[ForwardBatch, torch.Tensor | None]:
        batch, _ = self._build(sched)
        return batch, self._forward_logits(batch)

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
        from deepinfer.core.sampler import SamplingRow

        timer = self.timer
        if timer is not None:
            timer.begin()
        batch, sampling = self._build(sched)
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

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Forward the step and draw one token for every sequence that reached its last token (waits)."""
        return self.launch(sched).resolve()


@torch.inference_mode()
def profile_forward(
    model, block_size: int, num_tokens: int, max_seq_len: int, num_logits: int, device: torch.device
) -> None:
    """One forward of num_tokens prompt tokens (sequences of at most max_seq_len) and logits for
    num_logits rows, on a throw-away cache.

    Run before sizing the KV cache on devices that report memory: the allocator keeps the
    activation peak reserved afterwards, so the free memory measured next already excludes it.
    """
    specs = model.kv_cache_specs()
    lens = [min(max_seq_len, num_tokens - i) for i in range(0, num_tokens, max_seq_len)]
    per_seq = {s.name: max(1, -(-s.num_entries(max(lens)) // block_size)) for s in specs}
    blocks = {name: n * len(lens) for name, n in per_seq.items()}
    caches = KVCaches.allocate(specs, blocks, block_size, len(lens), device)
    pos = torch.cat([torch.arange(n, dtype=torch.int64) for n in lens])
    req = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    tables, slots = {}, {}
    for s in specs:
        n = per_seq[s.name]
        table = torch.arange(n * len(lens), dtype=torch.int32).view(len(lens), n)
        tables[s.name] = table.to(device)
        slots[s.name] = token_slots(table, req, pos, s.tokens_per_entry, block_size).to(device)
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    n_logits = max(1, min(num_logits, num_tokens))
    batch = ForwardBatch(
        input_ids=torch.zeros(num_tokens, dtype=torch.int64, device=device),
        positions=pos.to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        context_lens=torch.zeros(len(lens), dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=slots,
        logits_indices=torch.arange(num_tokens - n_logits, num_tokens, dtype=torch.int64, device=device),
        query_lens_cpu=list(lens),
        seq_lens_cpu=list(lens),
        context_lens_cpu=[0] * len(lens),
        state_slots=torch.arange(len(lens), dtype=torch.int32, device=device) if caches.state else None,
        state_slots_cpu=list(range(len(lens))) if caches.state else [],
        block_size=block_size,
    )
    hidden = model.forward(batch, caches)
    model.compute_logits(hidden[batch.logits_indices]).float()
    del hidden, caches, batch
