"""Decode-step graphs: what the model runner asks of a backend's graph runner, and the bucketed
static-input runner every graph API shares.

Launch overhead, not bandwidth, dominates small decode batches; a captured graph removes it.
The runner is the backend's (`Backend.make_graph_runner`): CUDA graphs on NVIDIA, ACL graphs on
Ascend. What does not depend on the graph API lives here, in `DecodeGraphRunner`: every input of
a decode step sits in a static buffer sized for the largest bucket; a step of B sequences copies
its inputs into the first B rows, pads the rest to the bucket (sequence length 0, KV slot -1:
padded rows read nothing and write nothing) and replays the bucket's graph. A subclass supplies
the three device calls: make a memory pool, capture one graph, replay one.
"""

from __future__ import annotations

import functools
import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.backend.forward_batch import ForwardBatch

log = logging.getLogger(__name__)


class GraphRunner(ABC):
    """What ModelRunner asks: may this batch replay a graph, and replay it (hidden states [T, D])."""

    @abstractmethod
    def can_run(self, batch: ForwardBatch) -> bool: ...

    @abstractmethod
    def run(self, batch: ForwardBatch) -> torch.Tensor: ...


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_num_seqs (which is always included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


@dataclass
class StaticInputs:
    """The static decode inputs a captured graph reads, sized for the largest bucket."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor
    used: int = 0  # rows 0..used-1 may hold an earlier step's real rows; the rest are padding already

    @classmethod
    def allocate(cls, n: int, max_blocks_per_seq: int, groups: list[str], device: torch.device) -> "StaticInputs":
        i64 = dict(dtype=torch.int64, device=device)
        i32 = dict(dtype=torch.int32, device=device)
        return cls(
            input_ids=torch.zeros(n, **i64), positions=torch.zeros(n, **i64),
            query_start_loc=torch.arange(n + 1, **i32), seq_lens=torch.zeros(n, **i32),
            context_lens=torch.zeros(n, **i32),
            block_tables={g: torch.zeros((n, max_blocks_per_seq), **i32) for g in groups},
            slot_mapping={g: torch.full((n,), -1, **i64) for g in groups},
            logits_indices=torch.arange(n, **i64),
        )

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

    def load(self, batch: ForwardBatch, size: int, groups: list[str]) -> None:
        """Copy a decode batch of B <= size rows into the first B rows; rows B..size-1 become padding.

        Only rows that held real rows since their last reset are reset (`used`): a run of steps at one batch size
        resets nothing, where resetting rows B..size-1 every step cost five launches (~5-8 us of host time each on
        a GPU) of a step that waits for its host. Padding is what it always was: ids, positions and lengths 0,
        KV slots -1 (no context, no KV write)."""
        b = batch.num_seqs
        self.input_ids[:b].copy_(batch.input_ids)
        self.positions[:b].copy_(batch.positions)
        self.seq_lens[:b].copy_(batch.seq_lens)
        self.context_lens[:b].copy_(batch.context_lens)
        end = min(self.used, size)
        if end > b:  # rows an earlier step filled that pad this one
            self.input_ids[b:end].zero_()
            self.positions[b:end].zero_()
            self.seq_lens[b:end].zero_()
            self.context_lens[b:end].zero_()
        for g in groups:
            src = batch.block_tables[g]
            self.block_tables[g][:b, : src.shape[1]].copy_(src)
            self.slot_mapping[g][:b].copy_(batch.slot_mapping[g])
            if end > b:
                self.slot_mapping[g][b:end].fill_(-1)
        self.used = b if self.used <= size else self.used  # rows past `size` keep what they held


@dataclass
class DecodeGraphRunner(GraphRunner):
    """Bucketed decode graphs over static inputs; subclasses supply the graph API.

    `capture` builds the static buffers and captures one graph per bucket, largest first (so a
    shared memory pool is sized once); models with per-sequence state (V4's compressor rows)
    get a runner that refuses every batch, since a padded row would write into a real row.
    """

    model: object
    caches: object
    block_size: int
    max_blocks_per_seq: int
    buckets: list[int]
    group_names: list[str]
    uses_state: bool = False
    graphs: dict[int, object] = field(default_factory=dict)
    outputs: dict[int, torch.Tensor] = field(default_factory=dict)
    static: StaticInputs | None = None

    # ------------------------------------------------------------ the graph API (per device)

    @abstractmethod
    def new_pool(self) -> object:
        """A memory pool the captured graphs share."""

    @abstractmethod
    def capture_one(self, fn: Callable[[], torch.Tensor], pool: object) -> tuple[object, torch.Tensor]:
        """Warm fn up, capture it into a graph using `pool`; (graph, its output tensor)."""

    @abstractmethod
    def replay(self, graph: object) -> None: ...

    def finish_capture(self) -> None:
        """Called once after every bucket is captured (e.g. a device synchronize)."""

    # ------------------------------------------------------------ device-agnostic part

    @classmethod
    def capture(cls, model, caches, block_size: int, max_model_len: int, max_num_seqs: int,
                device: torch.device, buckets: list[int] | None = None) -> "DecodeGraphRunner":
        buckets = sorted(buckets or default_buckets(max_num_seqs))
        names = sorted(caches.specs)
        runner = cls(model=model, caches=caches, block_size=block_size,
                     max_blocks_per_seq=-(-max_model_len // block_size) + 1, buckets=buckets,
                     group_names=names, uses_state=bool(caches.state))
        if runner.uses_state:  # can_run refuses every batch: no static buffers, no capture
            log.warning("decode graphs are off: this model keeps per-sequence state (no padding-safe row)")
            return runner
        runner.static = StaticInputs.allocate(max(buckets), runner.max_blocks_per_seq, names, device)
        runner._capture_all()
        return runner

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = self.new_pool()
        for b in sorted(self.buckets, reverse=True):  # largest first: the pool is sized once
            batch = self.static.batch(b, self.block_size)
            fn = functools.partial(self.model.forward, batch, self.caches)  # bound now: a graph API may call it later
            self.graphs[b], self.outputs[b] = self.capture_one(fn, pool)
        self.finish_capture()
        log.info("captured decode graphs for batch sizes %s", self.buckets)

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
        size = self.bucket_for(batch.num_seqs)
        self.static.load(batch, size, self.group_names)
        self.replay(self.graphs[size])
        return self.outputs[size][: batch.num_seqs]
