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
from deepinfer.outputs import Logprob


@dataclass
class StepResult:
    """The token drawn for each scheduled sequence that samples this step (None for mid-prompt chunks)."""

    token_ids: list[int | None]
    logprobs: list[dict[int, Logprob] | None]


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
        items = sched.scheduled
        query_lens: list[int] = []
        ctx_lens: list[int] = []
        seq_lens: list[int] = []
        input_ids: list[int] = []
        qsl = [0]
        logits_idx: list[int] = []
        total = 0
        for it in items:  # one pass; a decode's input is its last output token (no slice)
            seq, c, q = it.seq, it.context_len, it.num_tokens
            out_ids = seq.output_token_ids
            n = len(seq.request.prompt_token_ids) + len(out_ids)
            query_lens.append(q)
            ctx_lens.append(c)
            seq_lens.append(c + q)
            if q == 1 and c == n - 1 and out_ids:
                input_ids.append(out_ids[-1])
            else:
                input_ids.extend(seq.token_ids_slice(c, c + q))
            total += q
            qsl.append(total)
            if c + q == n:  # reaches the last token: samples (ScheduledSeq.samples)
                logits_idx.append(total - 1)

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

        state_slots_cpu: list[int] = []
        state_slots = None
        if self.kv.uses_state:
            state_slots_cpu = rows.tolist()
            state_slots = rows.to(torch.int32).to(self.device)

        dev = self.device
        return ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(dev),
            positions=positions.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(dev),
            context_lens=torch.tensor(ctx_lens, dtype=torch.int32).to(dev),
            block_tables={k: v.to(dev) for k, v in block_tables.items()},
            slot_mapping={k: v.to(dev) for k, v in slot_mapping.items()},
            logits_indices=torch.tensor(logits_idx, dtype=torch.int64).to(dev),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
            context_lens_cpu=ctx_lens,
            state_slots=state_slots,
            state_slots_cpu=state_slots_cpu,
            block_size=bs,
        )

    def reset_state_rows(self, batch: ForwardBatch) -> None:
        """Sequences starting from token 0 get zeroed per-sequence state (a reused row holds old data)."""
        if not self.caches.state:
            return
        fresh = [s for s, c in zip(batch.state_slots_cpu, batch.context_lens_cpu) if c == 0 and s >= 0]
        if not fresh:
            return
        rows = torch.tensor(fresh, dtype=torch.int64, device=self.device)
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
        batch = self.build_batch(sched)
        self.reset_state_rows(batch)
        hidden = self.run_model(batch)
        if batch.logits_indices.numel() == 0:
            return batch, None
        return batch, self.model.compute_logits(hidden[batch.logits_indices]).float()

    def execute(self, sched: SchedulerOutput) -> StepResult:
        """Forward the step and draw one token for every sequence that reached its last token."""
        from deepinfer.core.sampler import SamplingRow

        _, logits = self.compute_logits(sched)
        token_ids: list[int | None] = [None] * len(sched.scheduled)
        logprobs: list[dict[int, Logprob] | None] = [None] * len(sched.scheduled)
        if logits is None:
            return StepResult(token_ids, logprobs)
        sampling: list[int] = []
        rows = []
        for i, it in enumerate(sched.scheduled):
            seq = it.seq
            req = seq.request
            n = len(req.prompt_token_ids) + len(seq.output_token_ids)
            if it.context_len + it.num_tokens == n:  # ScheduledSeq.samples
                sampling.append(i)
                rows.append(SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids, seq.seed, n))
        with torch.inference_mode():
            out = self.sampler(logits, rows)
        for j, i in enumerate(sampling):
            token_ids[i] = int(out.token_ids[j])
            logprobs[i] = out.logprobs[j] if out.logprobs else None
        return StepResult(token_ids, logprobs)


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
