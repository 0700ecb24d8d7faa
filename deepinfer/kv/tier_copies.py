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
        host = [self.alloc(tuple(t.shape), t.dtype) for t in srcs]
        event = self.backend.copy_async(host, srcs, self.stream)
        self.num_to_host += 1
        if event is None:
            return host, None
        self.fences.append(event)
        backend = self.backend
        return host, lambda: backend.event_synchronize(event)

    def to_device(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """Queue a copy of one block's host parts into its device parts (read by the next step, after `fence`)."""
        event = self.backend.copy_async(dsts, srcs, self.stream)
        self.num_to_device += 1
        if event is not None:
            self.fences.append(event)

    def fence(self) -> int:
        """Make the compute stream wait for every copy queued since the last fence; returns how many events."""
        n = len(self.fences)
        for event in self.fences:
            self.backend.wait_event(event)
        self.fences.clear()
        return n
