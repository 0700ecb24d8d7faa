"""One KV block across a group's layers, as host tensors: what the prefix cache's lower tiers store.

The caches' layouts are the backend's (one tensor or several parts per layer, [num_blocks, block_size, ...]
each), so a block's payload is every part of every layer of the group, in layer order. The tiers copy through
`views(block)` and batches of blocks through `parts` with kv/tier_copies.py (the backend's copy stream, no host
sync); V4's window group adds its state snapshot slots (`add_parts`). read / write are the synchronous forms
(tests and tools).
"""

from __future__ import annotations

import torch

from deepinfer.backend import KVCaches


class KVBlockIO:
    def __init__(self, caches: KVCaches, group: str):
        self.group = group
        spec = caches.specs[group]
        self._parts = []
        for layer in spec.layer_ids:
            kv = caches.get(group, layer)
            self._parts.extend(kv if isinstance(kv, (tuple, list)) else (kv,))

    @property
    def parts(self) -> list[torch.Tensor]:
        """Every per-block tensor, [num_blocks, ...] each, in payload order (the tiers gather a batch from them)."""
        return self._parts

    @property
    def device(self) -> torch.device:
        return self._parts[0].device

    def like(self) -> list[torch.Tensor]:
        """Empty host tensors shaped and typed like one block's parts (the tiers check files against them)."""
        return [torch.empty(p.shape[1:], dtype=p.dtype) for p in self._parts]

    def views(self, block: int) -> list[torch.Tensor]:
        """The block's device parts (views into the caches), what the tiers' asynchronous copies read or fill."""
        return [p[block] for p in self._parts]

    def range_views(self, first: int, n: int) -> list[torch.Tensor]:
        """Blocks first .. first + n - 1 of every part (one contiguous view each: a run copied in one transfer)."""
        return [p[first: first + n] for p in self._parts]

    def add_parts(self, tensors: list[torch.Tensor]) -> None:
        """More per-block tensors ([num_blocks, ...] each) that travel with the block: V4's state snapshot slots
        (state_snapshots.StateSnapshots.slot_tensors), kept beside the sliding-window block of the same id."""
        n = self._parts[0].shape[0]
        if any(t.shape[0] != n for t in tensors):
            raise ValueError(f"the tensors added to group {self.group!r}'s blocks need {n} rows")
        self._parts.extend(tensors)

    def read(self, block: int) -> list[torch.Tensor]:
        return [p[block].to("cpu", copy=True) for p in self._parts]

    def check(self, parts: list[torch.Tensor]) -> None:
        if len(parts) != len(self._parts):
            raise ValueError(f"a block of group {self.group!r} has {len(self._parts)} parts, got {len(parts)}")

    def write(self, block: int, parts: list[torch.Tensor]) -> None:
        self.check(parts)
        for dst, src in zip(self._parts, parts):
            dst[block].copy_(src, non_blocking=False)
