"""One cp rank's batch of a split step (parallel/context_parallel.py plans it) and the exchange of the
step's KV entries between the cp ranks.

`split_batch` turns the step's ForwardBatch into this rank's: its tokens only (input ids, positions), one
row per Segment (query_len = the segment's length, context_len = the request's context plus the tokens of
the request before the segment, the request's block table), and logits rows for the sampled tokens it
owns. Its slot_mapping is -1 everywhere: the MLA op writes nothing itself. Instead each attention layer
(models/layers/cp_attention.py) all-gathers the new latent entries of every rank (`KVExchange.gather`)
and writes the whole step's entries into its own cache before its attention runs, so every cp rank keeps
the complete KV cache, bit-identical on every rank (written from the same gathered rows), and the next
step, split or not, needs nothing new. V4 (per-sequence compressor state) does the same with its per-token
KV inputs, replaying the whole step's cache writes in step order (models/deepseek_v4/cp_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from deepinfer.backend import Communicator, ForwardBatch
from deepinfer.errors import BackendError
from deepinfer.parallel.context_parallel import ContextParallelPlan


@dataclass
class KVExchange:
    """The step's KV entries between the cp ranks: each rank's rows padded to the longest rank's count.

    write_slots: KV group -> [cp * max_rows] int64, the slot of every row of the gathered (padded) tensor
    (-1 for padding), from the step's slot_mapping.
    plan / step / step_index: the split, the whole step's batch, and for every row of the step the row of the
    gathered (padded) tensor that holds it: what a layer whose cache writes run token after token within a
    sequence (V4's compressors, models/deepseek_v4/cp_attention.py) needs to replay the whole step in order."""

    comm: Communicator
    counts: list[int]
    write_slots: dict[str, torch.Tensor] = field(default_factory=dict)
    plan: ContextParallelPlan | None = None
    step: ForwardBatch | None = None
    step_index: torch.Tensor | None = None

    @property
    def max_rows(self) -> int:
        return max(self.counts)

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """This rank's [counts[rank], ...] rows -> every rank's, [cp * max_rows, ...] (padding rows zero)."""
        n = rows.shape[0]
        if n != self.counts[self.comm.rank]:
            raise BackendError(f"context parallel: rank {self.comm.rank} gathers {n} rows, its plan holds "
                               f"{self.counts[self.comm.rank]}")
        if n < self.max_rows:
            pad = rows.new_zeros((self.max_rows - n, *rows.shape[1:]))
            rows = torch.cat([rows, pad])
        return self.comm.all_gather(rows.contiguous(), dim=0)


@dataclass
class ContextParallelBatch(ForwardBatch):
    """This cp rank's part of a split step; `exchange` carries what its attention layers share."""

    exchange: KVExchange | None = None


@dataclass
class SplitStep:
    """A split step on this rank: its batch, and where each of the step's logits rows comes from in the
    gathered (padded) logits hidden states: row k of the step's logits_indices is gathered row pick[k]."""

    batch: ContextParallelBatch
    logits_counts: list[int]
    pick: torch.Tensor


def split_batch(batch: ForwardBatch, plan: ContextParallelPlan, comm: Communicator) -> SplitStep:
    """This rank's ContextParallelBatch of `batch` under `plan` (module docstring)."""
    rank, cp = comm.rank, comm.world_size
    if plan.cp_size != cp:
        raise BackendError(f"context parallel: the plan is for {plan.cp_size} ranks, the cp group has {cp}")
    dev = batch.input_ids.device
    segs, rows = plan.segments[rank], plan.rows[rank]
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    qlens = [s.length for s in segs]
    ctx = [batch.context_lens_cpu[s.request] + s.start for s in segs]
    seqs = [c + q for c, q in zip(ctx, qlens)]
    qsl = [0]
    for q in qlens:
        qsl.append(qsl[-1] + q)
    req = torch.tensor([s.request for s in segs], dtype=torch.long, device=dev)

    owner = plan.owner_of_rows(batch.num_tokens)
    logits_rows = batch.logits_indices.tolist()  # host list (a small copy; the CPU pays nothing)
    mine: list[list[int]] = [[] for _ in range(cp)]  # per rank: its local rows that get logits, in step order
    where = []
    for g in logits_rows:
        r, local = owner[g]
        where.append((r, len(mine[r])))
        mine[r].append(local)
    counts = [len(m) for m in mine]
    width = max(counts, default=0)
    pick = torch.tensor([r * width + j for r, j in where], dtype=torch.long, device=dev)

    exchange = KVExchange(comm, [len(r) for r in plan.rows], plan=plan, step=batch)
    exchange.step_index = torch.tensor([r * exchange.max_rows + j for r, j in owner], dtype=torch.long, device=dev)
    padded = []
    for r_rows in plan.rows:
        padded.extend(r_rows + [-1] * (exchange.max_rows - len(r_rows)))
    gidx = torch.tensor(padded, dtype=torch.long, device=dev)
    valid = gidx >= 0
    for group, slots in batch.slot_mapping.items():
        got = slots.index_select(0, gidx.clamp(min=0))
        exchange.write_slots[group] = torch.where(valid, got, torch.full_like(got, -1))

    local = ContextParallelBatch(
        input_ids=batch.input_ids.index_select(0, idx),
        positions=batch.positions.index_select(0, idx),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seqs, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=dev),
        block_tables={g: t.index_select(0, req) for g, t in batch.block_tables.items()},
        slot_mapping={g: torch.full((len(rows),), -1, dtype=torch.int64, device=dev) for g in batch.slot_mapping},
        logits_indices=torch.tensor(mine[rank], dtype=torch.long, device=dev),
        query_lens_cpu=qlens,
        seq_lens_cpu=seqs,
        context_lens_cpu=ctx,
        # a segment keeps its request's per-sequence state row (V4); the layer decides what it reads there
        state_slots=None if batch.state_slots is None else batch.state_slots.index_select(0, req),
        state_slots_cpu=[batch.state_slots_cpu[s.request] for s in segs] if batch.state_slots_cpu else [],
        block_size=batch.block_size,
        exchange=exchange,
    )
    return SplitStep(local, counts, pick)
