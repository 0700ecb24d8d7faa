"""The host tier of the prefix cache: evicted KV blocks in host memory, between the device and the disk.

A bounded LRU map per KV group from block key to a slot of the host pool (host_pool.py: one host buffer taken at
start-up, pinned on a GPU), with the `ready` callable that waits for the slot's device -> host copy (None: filled
already). The link (tier_link.py) reserves slots for a batch of evictions, has them filled in one gather and one
transfer per part and run (tier_copies.py), then commits the entries. A reservation beyond the free slots pushes
the group's least recently used entries out: without a disk tier their slots are free at once; with one they are
handed to the disk writer with a release callback, and the slot is free once its file is written (its bytes
must not change before). So that evictions rarely find no free slot while the writer works, a tier with a disk
keeps `headroom` slots free by pushing the oldest entries out early.

Lent entries: a hit's payloads are slot views, read by copies queued later in the same schedule pass (at
allocate). Until the link releases them (after the hit's copies are issued, or at the step's fence) a lent
entry is never pushed out, so its slot cannot be refilled under the hit. The copies themselves run in stream
order after any earlier fill of the slot, and a later fill is queued after them.

On the CPU the device cache is host memory already, so this tier only adds a second, larger pool there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer.kv.host_pool import HostPool

Ready = Callable[[], None] | None


@dataclass(frozen=True)
class SlotRef:
    """A hit's block held in slot `slot` of `group`'s host pool, lent to the hit (`HostTier.lend`). The link copies
    it up straight from the pool's regions, with the hit's other blocks in consecutive slots in one transfer per
    part (tier_link.py), so a hit makes no per-block, per-part host views."""

    group: str
    slot: int


# what a reservation pushes out towards the disk: (key, parts, ready, release); release frees the slot
Pushed = tuple[bytes, list[torch.Tensor], Ready, Callable[[], None]]


class HostTier:
    def __init__(self, max_bytes: int):
        """max_bytes: the pool's budget, allocated when the link carves it (`carve`, once the layouts are known)."""
        if max_bytes < 1:
            raise ValueError(f"kv host cache size must be positive, got {max_bytes} bytes")
        self.max_bytes = max_bytes
        self.pool: HostPool | None = None
        self._lru: dict[str, OrderedDict[bytes, tuple[int, Ready]]] = {}
        self._group_of: dict[bytes, str] = {}
        self._lent: set[bytes] = set()
        self.headroom: dict[str, int] = {}
        self.hits = self.misses = self.puts = 0
        self.dropped = 0  # evicted blocks no slot could take, without a disk tier (the link counts them)

    def carve(self, layouts: dict[str, list[tuple[torch.dtype, tuple]]], weights: dict[str, float],
              host_buffer: Callable[[tuple, torch.dtype], torch.Tensor], with_disk: bool) -> None:
        """Allocate the pool: layouts per group, budget shares, the backend's host buffer service. Again only while
        nothing was ever stored (start-up, when a group's block grows: V4's snapshot slots)."""
        if self.pool is not None and self.puts:
            raise ValueError("the host tier's pool is allocated at start-up, before any block is stored")
        self.pool = None  # the old arena goes before the new one is taken
        self.pool = HostPool(self.max_bytes, layouts, weights, host_buffer)
        self._lru = {g: OrderedDict() for g in layouts}
        self.headroom = {g: (max(1, s.num_slots // 16) if with_disk and s.num_slots > 1 else 0)
                         for g, s in self.pool.groups.items()}

    def __len__(self) -> int:
        return len(self._group_of)

    @property
    def size_bytes(self) -> int:
        """Bytes the entries hold (slots waiting for the disk writer not counted)."""
        return sum(len(lru) * self.pool.groups[g].slot_bytes for g, lru in self._lru.items())

    def contains(self, key: bytes) -> bool:
        return key in self._group_of

    def reserve(self, group: str, n: int, to_disk: Callable[[bytes], bool] | None) -> tuple[list[int], list[Pushed]]:
        """Up to n free slots for new entries of `group`, pushing its least recently used unlent entries out as
        needed (plus the headroom, with a disk). to_disk(key): whether a pushed entry must be written to disk
        (None: no disk tier); those come back as Pushed, their slots freed by `release` once written."""
        pool, lru = self.pool, self._lru[group]
        want = n + (self.headroom[group] if to_disk is not None else 0) - pool.num_free(group)
        pushed: list[Pushed] = []
        if want > 0:
            victims = []
            for key in lru:  # oldest first; stop as soon as enough are found
                if len(victims) == want:
                    break
                if key not in self._lent:
                    victims.append(key)
            for key in victims:
                slot, ready = lru.pop(key)
                del self._group_of[key]
                if to_disk is not None and to_disk(key):
                    pushed.append((key, pool.groups[group].views(slot), ready, self._releaser(group, slot)))
                else:
                    pool.give(group, slot)
        return pool.take(group, n), pushed

    def _releaser(self, group: str, slot: int) -> Callable[[], None]:
        return lambda: self.pool.give(group, slot)

    def commit(self, group: str, keys: list[bytes], slots: list[int], ready: Ready) -> None:
        """Enter reserved slots, filled (or filling behind `ready`) with these keys' blocks, as the newest."""
        lru = self._lru[group]
        for key, slot in zip(keys, slots):
            lru[key] = (slot, ready)
            self._group_of[key] = group
        self.puts += len(keys)

    def get(self, key: bytes, like: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The block's parts: views of its slot, lent until `release_lent` (a device copy from them is ordered
        after their fill on the copy stream). None when absent or shaped unlike `like`."""
        group = self._group_of.get(key)
        if group is None or not self.fits(group, like):
            self.misses += 1
            return None
        return self.pool.groups[group].views(self.lend(key).slot)

    def fits(self, group: str, like: list[torch.Tensor]) -> bool:
        """Whether `group`'s slots hold blocks shaped and typed like `like` (one check per hit, not per block)."""
        regions = self.pool.groups[group].regions
        return [(r.dtype, r.shape[1:]) for r in regions] == [(t.dtype, t.shape) for t in like]

    def lend(self, key: bytes) -> SlotRef | None:
        """The block's slot (None: not here), lent until `release_lent`, as the newest entry; no views are made.
        The caller checks the group's layout once (`fits`)."""
        group = self._group_of.get(key)
        if group is None:
            self.misses += 1
            return None
        slot, _ = self._lru[group][key]
        self._lru[group].move_to_end(key)
        self._lent.add(key)
        self.hits += 1
        return SlotRef(group, slot)

    def release_lent(self) -> None:
        """The hits' copies from lent slots are queued: their entries may be pushed out again."""
        self._lent.clear()
