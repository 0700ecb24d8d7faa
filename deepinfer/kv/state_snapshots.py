"""V4's compressor state at block boundaries, kept beside the sliding-window block that ends there.

A prefix hit of L tokens on V4 attaches cached blocks, but the compressors also carry per-sequence state:
a ring of the raw (kv, gate) projections of the last positions (native/v4_compressor.py), and the
compressed groups' last block is partly filled at most boundaries (entry e covers tokens [e*m, (e+1)*m),
a block holds block_size entries, so L // m entries end mid-block unless L is a multiple of
block_size * m). Neither can be recomputed without the whole prompt: the ring at L holds projections of
positions before L, which depend on every layer below, whose sliding windows reach further back again.

So both are snapshotted when the prompt is computed and restored on a hit:
- ring images: the V4 attention op writes, for every block boundary B inside a step, the ring a sequence
  would hold with B tokens computed (`plan`, set per step by the model runner), into slot s = the id of
  the sequence's sliding-window block that ends at B;
- partial compressed blocks: when that block's key is registered (after the step), the first
  (B // m) % block_size entries of the compressed block holding entry B // m are copied to slot s.

Slot s belongs to sliding-window block s: it is valid while that block is keyed, and overwritten once the
block is evicted and reused, so snapshots are evicted with their block and need no bookkeeping of their own.
A hit of L needs sliding-window block L / block_size - 1 anyway (it is inside the window), and restores
from its slot (`restore`) into the sequence's state row and fresh partial block, at schedule time, before
the step that reads them (V4 runs sync: no step is in flight then).
"""

from __future__ import annotations

import torch

from deepinfer.backend import KVCaches, KVCacheSpec, KVLayout


def _parts(cache) -> tuple[torch.Tensor, ...]:
    return tuple(cache) if isinstance(cache, (tuple, list)) else (cache,)


def snapshot_bytes_per_block(specs: list[KVCacheSpec], block_size: int,
                             layouts: dict[str, KVLayout] | None = None) -> int:
    """Bytes one slot takes: every stateful group's ring image and one block of entries, per layer."""
    total = 0
    for s in specs:
        if not s.state_shape:
            continue
        layout = (layouts or {}).get(s.name) or KVLayout.single(s)
        total += s.state_bytes_per_seq() + block_size * layout.bytes_per_entry() * len(s.layer_ids)
    return total


def partial_entries(groups: list[KVCacheSpec], block_size: int, num_tokens: int) -> dict[str, tuple[int, int]]:
    """group -> (table index of the partly filled block, entries it holds) once num_tokens are computed;
    groups whose entries end on a block boundary are left out."""
    out = {}
    for s in groups:
        n = s.num_entries(num_tokens)
        if n % block_size:
            out[s.name] = (n // block_size, n % block_size)
    return out


class StateSnapshots:
    """Slots 0..num_slots-1 (one per block of the sliding-window group) of ring images and partial entries."""

    def __init__(self, caches: KVCaches, num_slots: int):
        self.caches = caches
        self.block_size = caches.block_size
        self.groups = [s for s in caches.specs.values() if s.state_shape]
        self.rings: dict[tuple[str, int], torch.Tensor] = {}
        self.entries: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}
        for s in self.groups:
            for layer in s.layer_ids:
                st = caches.get_state(s.name, layer)
                self.rings[(s.name, layer)] = torch.zeros((num_slots, *st.shape[1:]), dtype=st.dtype, device=st.device)
                self.entries[(s.name, layer)] = tuple(torch.zeros_like(p[:1]).expand(num_slots, *p.shape[1:]).clone()
                                                      for p in _parts(caches.get(s.name, layer)))
        # the step being launched: per scheduled request, [(boundary B, slot)] for every block boundary
        # ctx < B <= ctx + q (set by the model runner, read by the V4 op; None: nothing to capture)
        self.plan: list[list[tuple[int, int]]] | None = None

    @property
    def nbytes(self) -> int:
        rings = sum(t.numel() * t.element_size() for t in self.rings.values())
        return rings + sum(p.numel() * p.element_size() for ps in self.entries.values() for p in ps)

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor of the store, [num_slots, ...] each, in a fixed order: what a window block carries to the
        host / disk tiers with it (worker/kv_block_io.KVBlockIO.add_parts)."""
        return [*self.rings.values(), *(p for ps in self.entries.values() for p in ps)]

    def partial_entries(self, num_tokens: int) -> dict[str, tuple[int, int]]:
        return partial_entries(self.groups, self.block_size, num_tokens)

    def capture_entries(self, slot: int, blocks: dict[str, tuple[int, int]]) -> None:
        """Copy the first n entries of block b of each group ({group: (b, n)}) into the slot."""
        for group, (block, n) in blocks.items():
            for layer in self.caches.specs[group].layer_ids:
                for dst, src in zip(self.entries[(group, layer)], _parts(self.caches.get(group, layer))):
                    dst[slot, :n].copy_(src[block, :n])

    def restore(self, slot: int, row: int, blocks: dict[str, tuple[int, int]], copies=None) -> None:
        """The slot's rings into state row `row` of every stateful group, and its partial entries into the
        sequence's fresh blocks ({group: (block, n)}). copies: a tier_copies.TierCopies to queue them on (with the
        lower tiers, whose copy up may be what fills the slot: the same stream keeps them in order); None: now."""
        dsts, srcs = [], []
        for (group, layer), ring in self.rings.items():
            dsts.append(self.caches.get_state(group, layer)[row])
            srcs.append(ring[slot])
        for group, (block, n) in blocks.items():
            for layer in self.caches.specs[group].layer_ids:
                for src, dst in zip(self.entries[(group, layer)], _parts(self.caches.get(group, layer))):
                    dsts.append(dst[block, :n])
                    srcs.append(src[slot, :n])
        if copies is not None:
            copies.queue_to_device(dsts, srcs)
            return
        for dst, src in zip(dsts, srcs):
            dst.copy_(src)

