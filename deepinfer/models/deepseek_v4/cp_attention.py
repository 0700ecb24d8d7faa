"""DeepSeek-V4 attention of one cp rank in a split step (context-parallel prefill, parallel/cp_batch.py).

V4's caches are not written entry by entry from one token each, as MLA's latent: a compressed entry pools m
(CSA: 2m) tokens' projections, and the compressor's per-sequence ring carries the raw projections of the
unfinished window from one step to the next (backend/native/v4_compressor.py). Each cp rank holds query
segments from the middle of a prompt, so each needs the state the ring would have at its segment's start.
So, per attention layer of a split step:
1. each rank projects its own tokens (attention.py, unchanged) and all-gathers their per-token KV inputs over
   "cp": the shared key/value head, and on compressed layers the compressor's kv and gate projections (CSA:
   also the indexer's); not q, not the indexer's queries (those stay with their rank);
2. every rank replays the whole step's cache writes in step order (`replay_step_writes`): the sliding-window
   keys at their slots, and for every request its segments (over all ranks) one after another through the
   op's own per-request compressor step: the entries the segment's tokens close, at their slots; the prefix
   cache's ring images at the block boundaries inside it; the ring update. Same inputs, same calls on every
   rank: the caches and rings stay bit-identical, and end as one process leaves them (up to the rounding of
   the projections), so decode needs nothing new. Before each of this rank's segments the ring is copied
   aside: the state that segment starts from;
3. the op attends for this rank's segments only, over a view of the caches (`KVCaches` sharing the cache
   tensors) whose state rows are those copies. For its segments it recomputes the entries they close from
   the same ring and the same projections (the same call as in 2, so the same bits) and writes them at the
   same slots, updates only the copies, and writes no sliding-window key (slot -1: written in 2).

The replay calls the torch-native op's compressor step (NativeV4Attention._compress: the V4AttentionOp contract
has no public "write these rows" entry point yet), so the model allows a split only when every layer's op is
the native one (`context_parallel_reasons`); a backend's own V4 op would need that entry point in the contract.
Cost per split step and CSA / HCA layer: the compressor runs over the whole step on every rank (linear in the
step's tokens), and each replayed segment re-reads its request's compressed entries (the op's step returns
them), which grows with the context and the number of segments.
Hash routing and the hyper-connections act per token: the rank's own tokens and token ids go through them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from deepinfer.backend import KVCaches, NativeV4Attention
from deepinfer.errors import BackendError
from deepinfer.parallel.context_parallel import Segment
from deepinfer.parallel.cp_batch import ContextParallelBatch, KVExchange


@dataclass
class V4SplitStep:
    """One split step as every V4 layer of this rank sees it (built once per step by the model).

    order[i]: request i's segments over all ranks, by start; own[j]: (request, index in order[request]) of
    this rank's j-th segment (its batch's row j); own_rows: this rank's rows of the step; snapshots: prefix
    caching's StateSnapshots when the step crosses a block boundary (its plan is per request of the step)."""

    exchange: KVExchange
    order: list[list[Segment]]
    own: list[tuple[int, int]]
    own_rows: torch.Tensor
    step_starts: list[int]
    snapshots: object | None = None


def v4_split_step(batch: ContextParallelBatch, snapshots=None) -> V4SplitStep:
    ex = batch.exchange
    if ex is None or ex.plan is None or ex.step is None or ex.step_index is None:
        raise BackendError("context parallel (V4): a ContextParallelBatch without its step and plan")
    step, plan, rank = ex.step, ex.plan, ex.comm.rank
    order: list[list[Segment]] = [[] for _ in step.query_lens_cpu]
    for segs in plan.segments:
        for s in segs:
            order[s.request].append(s)
    for segs in order:
        segs.sort(key=lambda s: s.start)
    own = [(s.request, order[s.request].index(s)) for s in plan.segments[rank]]
    starts = [0]
    for q in step.query_lens_cpu:
        starts.append(starts[-1] + q)
    rows = torch.tensor(plan.rows[rank], dtype=torch.long, device=step.input_ids.device)
    return V4SplitStep(ex, order, own, rows, starts, snapshots)


def context_parallel_reasons(layers) -> list[str]:
    """Why these V4 attention layers cannot run a split step (empty: they can)."""
    other = sorted({type(layer.op).__name__ for layer in layers if not isinstance(layer.op, NativeV4Attention)})
    if not other:
        return []
    return [(f"DeepSeek-V4 context-parallel prefill replays the step's cache writes through the torch-native V4 "
             f"op's compressor step; this backend's V4 attention op ({', '.join(other)}) owns its own layout")]


def _gather_step(ex: KVExchange, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's per-token rows of each part -> the whole step's, in step order (one all-gather when the
    parts share a dtype)."""
    if len({p.dtype for p in parts}) == 1:
        widths = [p.shape[-1] for p in parts]
        every = ex.gather(torch.cat(parts, dim=-1)).index_select(0, ex.step_index)
        return list(every.split(widths, dim=-1))
    return [ex.gather(p).index_select(0, ex.step_index) for p in parts]


def replay_step_writes(layer, split: V4SplitStep, group: str, prefix: str, kv: torch.Tensor, gate: torch.Tensor,
                       caches: KVCaches) -> torch.Tensor:
    """Module docstring, step 2, for one compressed group: the whole step's [T, width] projections `kv` /
    `gate` (step order). Returns [own segments, *ring] the ring at the start of each of this rank's segments.

    Each segment goes through the native op's own per-request compressor step (`_compress`: the ring, the
    entries the segment closes at their slots, the ring images at block boundaries, the ring update), the very
    call its forward makes for a request row, so what this writes is what the op computes for its rows. The
    V4AttentionOp contract has no public "write these rows" entry point yet; context_parallel_reasons admits
    only the native op, whose method this is."""
    op, spec, lid = layer.op, layer.op.spec, layer.layer_id
    overlap = True if group == spec.index_group else spec.overlap  # as the op's forward calls it
    step = split.exchange.step
    if not step.state_slots_cpu:
        raise BackendError("V4 compressed attention needs batch.state_slots (per-sequence state rows)")
    state = caches.get_state(group, lid)
    slots, tables = step.slot_mapping[group], step.block_tables[group]
    plan = split.snapshots.plan if split.snapshots is not None else None
    rings = split.snapshots.rings if plan is not None else None
    own_at = {key: j for j, key in enumerate(split.own)}
    starts = state.new_empty((len(split.own), *state.shape[1:]))
    for i, segs in enumerate(split.order):
        row, ctx0 = step.state_slots_cpu[i], step.context_lens_cpu[i]
        for k, seg in enumerate(segs):
            a, ctx = split.step_starts[i] + seg.start, ctx0 + seg.start
            b, seq = a + seg.length, ctx + seg.length
            if (i, k) in own_at:
                starts[own_at[(i, k)]].copy_(state[row])
            # the prefix cache's ring images at the block boundaries inside this segment
            snaps = [(B, dst) for B, dst in plan[i] if ctx < B <= seq] if plan is not None else None
            op._compress(group, prefix, kv[a:b], gate[a:b], caches, lid, row, ctx, seq, tables[i], overlap,
                         slots[a:b], snaps, rings)
    return starts


def context_parallel_v4(layer, q: torch.Tensor, kv: torch.Tensor, extra: dict, caches: KVCaches,
                        batch: ContextParallelBatch, split: V4SplitStep) -> torch.Tensor:
    """[T, H, D] for this rank's tokens (before the inverse RoPE), as `layer.op.forward` returns; `extra`: the
    op's keyword inputs for this rank's tokens (attention.py)."""
    spec, lid, ex = layer.op.spec, layer.layer_id, split.exchange
    step = ex.step
    names = ["kv"] + (["comp_kv", "comp_gate"] if spec.compress_rate else []) + \
        (["index_kv", "index_gate"] if spec.overlap else [])
    every = dict(zip(names, _gather_step(ex, [kv] + [extra[n] for n in names[1:]])))
    layer.backend.kv_cache_write(caches.get(spec.swa_group, lid), step.slot_mapping[spec.swa_group], every["kv"])
    state: dict[tuple[str, int], torch.Tensor] = {}
    slot_mapping = dict(batch.slot_mapping)  # -1 everywhere (cp_batch.split_batch): sliding keys written above
    if spec.compress_rate:
        state[(spec.comp_group, lid)] = replay_step_writes(layer, split, spec.comp_group, "compressor",
                                                           every["comp_kv"], every["comp_gate"], caches)
        slot_mapping[spec.comp_group] = step.slot_mapping[spec.comp_group].index_select(0, split.own_rows)
    if spec.overlap:
        state[(spec.index_group, lid)] = replay_step_writes(layer, split, spec.index_group, "indexer",
                                                            every["index_kv"], every["index_gate"], caches)
        slot_mapping[spec.index_group] = step.slot_mapping[spec.index_group].index_select(0, split.own_rows)
    view = KVCaches(specs=caches.specs, block_size=caches.block_size, layouts=caches.layouts, kv=caches.kv,
                    state=state)
    n = len(split.own)
    rows = dataclasses.replace(batch, slot_mapping=slot_mapping, state_slots_cpu=list(range(n)),
                               state_slots=torch.arange(n, dtype=torch.int32, device=q.device))
    op_extra = {k: v for k, v in extra.items() if k != "state_snapshots"}
    return layer.op.forward(q, kv, view, lid, rows, **op_extra)
