"""Decode-step CUDA graphs: capture the model forward for bucketed batch sizes, replay each step.

Device-agnostic by contract: it is built only when `backend.caps.graph_capture`
is true (and `enforce_eager` is off), and it uses `torch.cuda.CUDAGraph`, the
graph API torch exposes for such devices. Every input of a decode step lives
in a static buffer sized for the largest bucket; a step of B sequences copies
its inputs into the first B rows, pads the rest to the bucket (sequence
length 0, KV slot -1: padded rows read nothing and write nothing) and replays
the bucket's graph. Launch overhead, not bandwidth, dominates small decode
batches, which is what this removes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from deepinfer.core.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor

    def batch(self, b: int, block_size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:b], positions=self.positions[:b],
            query_start_loc=self.query_start_loc[: b + 1], seq_lens=self.seq_lens[:b],
            context_lens=self.context_lens[:b],
            block_tables={k: v[:b] for k, v in self.block_tables.items()},
            slot_mapping={k: v[:b] for k, v in self.slot_mapping.items()},
            logits_indices=self.logits_indices[:b],
            query_lens_cpu=[1] * b, seq_lens_cpu=[1] * b, context_lens_cpu=[0] * b,
            state_slots=None, state_slots_cpu=[],  # runners exist only for stateless models
            block_size=block_size,
        )


@dataclass
class CUDAGraphRunner:
    """Replays captured decode graphs; `can_run` / `run` is what ModelRunner asks of it."""

    model: object
    caches: object
    block_size: int
    max_blocks_per_seq: int
    buckets: list[int]
    group_names: list[str]
    uses_state: bool = False
    graphs: dict[int, torch.cuda.CUDAGraph] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    static: _StaticInputs | None = None

    @classmethod
    def capture(cls, model, caches, block_size: int, max_model_len: int, max_num_seqs: int,
                device: torch.device, buckets: list[int] | None = None) -> "CUDAGraphRunner":
        buckets = sorted(buckets or default_buckets(max_num_seqs))
        names = sorted(caches.specs)
        runner = cls(model=model, caches=caches, block_size=block_size,
                     max_blocks_per_seq=-(-max_model_len // block_size) + 1, buckets=buckets,
                     group_names=names, uses_state=bool(caches.state))
        if runner.uses_state:  # can_run refuses every batch: no static buffers, no capture
            log.warning("decode CUDA graphs are off: this model keeps per-sequence state (no padding-safe row)")
            return runner
        runner._allocate(device)
        runner._capture_all()
        return runner

    def _allocate(self, device: torch.device) -> None:
        n = max(self.buckets)
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        self.static = _StaticInputs(
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            query_start_loc=torch.arange(n + 1, **i32), seq_lens=torch.zeros(n, **i32),
            context_lens=torch.zeros(n, **i32),
            block_tables={g: torch.zeros((n, self.max_blocks_per_seq), **i32) for g in self.group_names},
            slot_mapping={g: torch.full((n,), -1, **i64) for g in self.group_names},
            logits_indices=torch.arange(n, **i64),
        )

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for b in sorted(self.buckets, reverse=True):  # largest first: the pool is sized once
            batch = self.static.batch(b, self.block_size)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, allocator settles
                    self.model.forward(batch, self.caches)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[b] = self.model.forward(batch, self.caches)
            self.graphs[b] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def bucket_for(self, b: int) -> int | None:
        for size in self.buckets:
            if size >= b:
                return size
        return None

    def can_run(self, batch: ForwardBatch) -> bool:
        if self.uses_state or not batch.query_lens_cpu or not batch.is_decode_only:
            return False  # per-sequence state pools (V4) have no padding row to absorb padded writes
        if self.bucket_for(batch.num_seqs) is None or set(batch.block_tables) != set(self.group_names):
            return False
        return all(t.shape[1] <= self.max_blocks_per_seq for t in batch.block_tables.values())

    @torch.inference_mode()
    def run(self, batch: ForwardBatch) -> torch.Tensor:
        b = batch.num_seqs
        size = self.bucket_for(b)
        st = self.static
        st.input_ids[:b].copy_(batch.input_ids)
        st.positions[:b].copy_(batch.positions)
        st.seq_lens[:b].copy_(batch.seq_lens)
        st.context_lens[:b].copy_(batch.context_lens)
        if size > b:  # padded rows: no context, no KV write
            st.input_ids[b:size].zero_()
            st.positions[b:size].zero_()
            st.seq_lens[b:size].zero_()
            st.context_lens[b:size].zero_()
        for g in self.group_names:
            src = batch.block_tables[g]
            st.block_tables[g][:b, : src.shape[1]].copy_(src)
            st.slot_mapping[g][:b].copy_(batch.slot_mapping[g])
            st.slot_mapping[g][b:size].fill_(-1)
        self.graphs[size].replay()
        return self.outputs[size][:b]
