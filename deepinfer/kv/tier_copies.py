"""The KV tiers' device <-> host copies, queued on the backend's copy stream so the host never waits for them.

Why: an eviction (device -> host) or a prefetch (host -> device) decided at schedule time used to copy block by
block with host syncs, each waiting for the step in flight. Here a copy is queued on the backend's side stream
(Backend.copy_async: ordered after the compute stream's queued work, because a block handed out may still be
written by the step in flight) and leaves an event. Two rules make it safe:

- the compute stream waits (a stream wait, not a host sync) on every copy queued since the last launch before
  the next step runs (`fence`, called by the model runner at launch): so an evicted block is overwritten only
  after its copy to the host has read it, and a prefetched block is read only after it has arrived;
- host memory a device -> host copy fills is read on the host only behind its event (`ready` callables, e.g. the
  disk tier's writer thread); host -> device copies from it run on the same stream, so stream order covers them.

With the native services (the cpu backend) copy_async runs at once and returns no event: there is no queue.

Copies up (a hit's blocks, V4's snapshot restores) are not issued one block at a time: `queue_to_device` collects
them and `flush` sends everything collected in ONE copy_async call (one event, one wait for the compute stream).
The link merges a hit's blocks that land in consecutive device blocks into one copy per cache part (staged in one
host buffer), so a hit of k blocks into a run of k blocks is `parts` transfers, not k * parts. `flush` runs at
`fence` (the launch of the step that reads them) and before any copy down (which may read a block just loaded),
so the copies keep program order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

ARENA_BYTES = 64 * 1024 * 1024  # host buffers are carved from chunks this large (one pinned allocation each)
ALIGN = 256


@dataclass
class TierCopies:
    """backend: the engine's Backend (its copy services); fences: events of copies queued since the last fence."""

    backend: object
    stream: object | None = None
    fences: list = field(default_factory=list)
    num_to_host: int = 0  # blocks copied down (evictions)
    num_to_device: int = 0  # blocks copied up (prefetches)
    num_calls: int = 0  # copy_async calls issued (both directions)
    num_transfers: int = 0  # (dst, src) tensor pairs in those calls
    pending: list = field(default_factory=list)  # copies up collected for the next flush: (dst, src)

    def __post_init__(self) -> None:
        self.stream = self.backend.copy_stream()
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()  # alloc is called from the disk tier's read threads too

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer for one part. Pinning memory costs far more per call than the copy of a block (on CUDA
        each pinned allocation is a driver call), so parts are views into ARENA_BYTES chunks from
        backend.host_buffer; a chunk is freed when the last part viewing it is dropped."""
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if nbytes > ARENA_BYTES // 4:
            return self.backend.host_buffer(shape, dtype)
        with self._lock:
            if self._chunk is None or self._used + nbytes > ARENA_BYTES:
                self._chunk, self._used = self.backend.host_buffer((ARENA_BYTES,), torch.uint8), 0
            start = self._used
            self._used = -(-(start + nbytes) // ALIGN) * ALIGN
            return self._chunk[start: start + nbytes].view(dtype).view(shape)

    def to_host(self, srcs: list[torch.Tensor]) -> tuple[list[torch.Tensor], Callable[[], None] | None]:
        """Queue a copy of one block's device parts into new host buffers; returns (host parts, ready), where
        ready() blocks until the parts hold the data (None: they do already)."""
        self.flush()  # a block loaded this step may be the one copied down now: its copy up goes first
        host = [self.alloc(tuple(t.shape), t.dtype) for t in srcs]
        event = self._copy(host, srcs)
        self.num_to_host += 1
        if event is None:
            return host, None
        self.fences.append(event)
        backend = self.backend
        return host, lambda: backend.event_synchronize(event)

    def _copy(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]):
        self.num_calls += 1
        self.num_transfers += len(dsts)
        return self.backend.copy_async(dsts, srcs, self.stream)

    def to_device(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Queue a copy of one block's host parts into its device parts (read by the next step, after `fence`)."""
        self.queue_to_device(dsts, srcs, blocks=1)

    def queue_to_device(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], blocks: int = 0) -> None:
        """Collect copies up (into device blocks, or V4's state rows) for the next `flush`; `blocks`: how many KV
        blocks they carry (counted in num_to_device)."""
        self.pending.extend(zip(dsts, srcs))
        self.num_to_device += blocks

    def flush(self) -> None:
        """Issue every collected copy up in one copy_async call."""
        if not self.pending:
            return
        dsts, srcs = [d for d, _ in self.pending], [s for _, s in self.pending]
        self.pending = []
        event = self._copy(dsts, srcs)
        if event is not None:
            self.fences.append(event)

    def fence(self) -> int:
        """Make the compute stream wait for every copy queued since the last fence (the collected copies up are
        issued first); returns how many events."""
        self.flush()
        n = len(self.fences)
        for event in self.fences:
            self.backend.wait_event(event)
        self.fences.clear()
        return n
