"""The host tier's memory: one host buffer allocated at start-up, carved into fixed-size block slots per KV group.

Why: allocating host memory as blocks are evicted cost more than the copies themselves (on CUDA each pinned
allocation is a driver call; on the CPU fresh pages fault in on first touch), and an eviction batch needs its
destination in a few contiguous runs so that one transfer per cache part and run moves it. So the whole
`--kv-host-cache-gib` budget is taken once, through the backend's host buffer service (pinned on NVIDIA, plain
memory on the CPU), and touched once; after that an eviction only pops slots from a free list.

Layout: per group, per cache part, one region [num_slots, *part shape] of the part's dtype (part-major, so a run
of consecutive slots is one contiguous tensor per part, the destination of one device -> host transfer). The
budget is split between groups in proportion to their device pools' bytes (V4: the window group with its state
snapshots, the compressed groups), so the host tier mirrors the device's mix; V2 / V3 have one group.

The free list is shared with the disk tier's writer thread (a slot pushed out to disk is freed once its file is
written), hence the lock.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.backend import host_memory_info
from deepinfer.errors import ConfigError

ALIGN = 256  # bytes: every region starts on this boundary (dtype views and DMA like aligned starts)


@dataclass
class GroupSlots:
    """One group's slots: per part a region [num_slots, *shape]; free slot ids, lowest first at start-up."""

    regions: list[torch.Tensor]
    slot_bytes: int
    free: deque = field(default_factory=deque)

    @property
    def num_slots(self) -> int:
        return self.regions[0].shape[0]

    def views(self, slot: int) -> list[torch.Tensor]:
        return [r[slot] for r in self.regions]


def slot_bytes(layout: list[tuple[torch.dtype, tuple]]) -> int:
    """Bytes one block takes in the pool (its parts' bytes; only whole regions are aligned)."""
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() for dtype, shape in layout)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class HostPool:
    """layouts: {group: [(dtype, shape) of each part of one block]}; weights: {group: share of the budget};
    host_buffer: the backend's Backend.host_buffer (called exactly once here)."""

    def __init__(self, max_bytes: int, layouts: dict[str, list[tuple[torch.dtype, tuple]]],
                 weights: dict[str, float], host_buffer: Callable[[tuple, torch.dtype], torch.Tensor],
                 flag: str = "--kv-host-cache-gib"):
        total_w = sum(weights.values())
        counts = {}
        for g, layout in layouts.items():
            sb = slot_bytes(layout)
            # each region of a group is rounded up to ALIGN: budget the slots with that slack taken off
            counts[g] = int((max_bytes * weights[g] / total_w - ALIGN * len(layout)) // sb)
            if counts[g] < 1:
                raise ConfigError(f"{flag}: {max_bytes / 2**30:.6g} GiB cannot hold one block of KV group {g!r} "
                                 f"({sb} bytes, {weights[g] / total_w:.0%} of the host tier); raise it")
        sizes = {g: [counts[g] * torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for d, s in lay]
                 for g, lay in layouts.items()}
        self.nbytes = sum(_aligned(n) for ns in sizes.values() for n in ns)
        available, total = host_memory_info()
        if self.nbytes > available:
            raise ConfigError(f"{flag}: {self.nbytes / 2**30:.3g} GiB asked for the KV host tier, but this machine has "
                              f"{available / 2**30:.3g} GiB of {total / 2**30:.3g} GiB host memory available; lower it")
        try:
            self.arena = host_buffer((self.nbytes,), torch.uint8)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(f"{flag}: cannot allocate {self.nbytes / 2**30:.3g} GiB of host memory for the KV host "
                             f"tier ({exc}); lower it") from exc
        if self.arena.device.type == "cpu" and not self.arena.is_pinned():
            self.arena.zero_()  # fault the pages in now, not on the eviction that first writes them
        self.groups: dict[str, GroupSlots] = {}
        off = 0
        for g, layout in layouts.items():
            regions = []
            for (dtype, shape), n in zip(layout, sizes[g]):
                regions.append(self.arena[off: off + n].view(dtype).view(counts[g], *shape))
                off += _aligned(n)
            self.groups[g] = GroupSlots(regions, slot_bytes(layout), deque(range(counts[g])))
        self._lock = threading.Lock()

    def num_free(self, group: str) -> int:
        return len(self.groups[group].free)

    def take(self, group: str, n: int) -> list[int]:
        """Up to n free slots of `group` (fewer when the free list is shorter), in ascending runs where it can."""
        slots = self.groups[group]
        with self._lock:
            k = min(n, len(slots.free))
            return [slots.free.popleft() for _ in range(k)]

    def give(self, group: str, slot: int) -> None:
        """A slot is free again (its entry was dropped, or written to disk: may run on the writer thread)."""
        with self._lock:
            self.groups[group].free.append(slot)

    def runs(self, group: str, slots: list[int]) -> list[tuple[int, int, list[torch.Tensor]]]:
        """The slots as (first row in `slots`, row count, per part the region rows [s, s + count)) for each run of
        consecutive slot ids: one contiguous destination tensor per part and run."""
        regions, out, start = self.groups[group].regions, [], 0
        for i in range(1, len(slots) + 1):
            if i == len(slots) or slots[i] != slots[i - 1] + 1:
                s, n = slots[start], i - start
                out.append((start, n, [r[s: s + n] for r in regions]))
                start = i
        return out
