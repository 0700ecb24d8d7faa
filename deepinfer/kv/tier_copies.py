"""The KV tiers' device <-> host copies, queued on the backend's copy stream so the host never waits for them.

Why: an eviction (device -> host) or a prefetch (host -> device) decided at schedule time used to copy block by
block with host syncs, each waiting for the step in flight. Here a copy is queued on the backend's side stream
(Backend.copy_async: ordered after the compute stream's queued work, because a block handed out may still be
written by the step in flight) and leaves an event. Two rules make it safe:

- a copy down reads a gather of the evicted blocks made on the compute stream (behind the step in flight, which
  may still write them), never the blocks themselves, so a block handed out is free to be overwritten by the next
  step while its copy to the host still runs: copies down overlap the next step's compute on the device (the
  gathered tensors live until the copy's event is done, `down`);
- the compute stream waits (a stream wait, not a host sync) on every copy UP queued since the last launch before
  the next step runs (`fence`, called by the model runner at launch): a prefetched block is read only after it
  has arrived;
- host memory a device -> host copy fills is read on the host only behind its event (`ready` callables, e.g. the
  disk tier's writer thread); host -> device copies from it run on the same stream, so stream order covers them.

With the native services (the cpu backend) copy_async runs at once and returns no event: there is no queue.

Copies up (a hit's blocks, V4's snapshot restores) are not issued one block at a time: `queue_to_device` collects
them and `flush` sends everything collected in ONE copy_async call (one event, one wait for the compute stream).
The link places a host-tier hit's blocks on its fresh device blocks in slot order and copies each run of consecutive
slots in one transfer per cache part, straight from the host pool's regions (disk payloads landing in consecutive
blocks are staged in one host buffer where copies are synchronous), so a hit of k blocks in one run of slots is
`parts` transfers, not k * parts. `flush` runs at
`fence` (the launch of the step that reads them) and before any copy down (which may read a block just loaded),
so the copies keep program order.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

import torch

from deepinfer.backend import Backend
from deepinfer.worker.transfer import to_device

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
    down: list = field(default_factory=list)  # copies down in flight: (event, the gathered device tensors they read)

    def __post_init__(self) -> None:
        self.stream = self.backend.copy_stream()
        # the backend's copies are the native synchronous copy_ (the cpu backend's): see to_host_batch
        self.native = self.stream is None and type(self.backend).copy_async is Backend.copy_async
        self._chunk: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()  # alloc is called from the disk tier's read threads too

    def alloc(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer outside the host tier's pool: disk reads, and evictions straight to disk (no host tier, or
        no free slot). Pinning memory costs far more per call than the copy of a block (on CUDA
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

    def to_host_batch(self, parts: list[torch.Tensor], blocks: list[int],
                      runs: list[tuple[int, int, list[torch.Tensor]]]) -> Callable[[], None] | None:
        """Queue the copy of many blocks down in one copy_async call: per cache part one gather of the blocks on
        the device (parts: [num_blocks, ...] device tensors), then one transfer per part and destination run.
        runs: (first row, row count, per part a host tensor [count, ...]) covering rows 0 .. len(blocks) - 1 in
        order. Returns ready(), which blocks until the host holds the data (None: it does already).

        The gather runs on the compute stream, so it reads a block after the step in flight has written it: one
        index_select per part, its block ids uploaded through pinned memory without a host wait
        (worker/transfer.to_device; per-block views were one Python call per block and part: ~3,500 for 128
        blocks of 27 layers). The copy reads the gathered tensors, not the blocks, so the next step does not wait
        for it (no fence): the gathered tensors are kept until its event is done (`down`, pruned at each fence)."""
        self.flush()  # a block loaded this step may be the one copied down now: its copy up goes first
        if self.stream is not None:
            for event in self.fences:  # the gather (compute stream) after the copies up issued so far
                self.backend.wait_event(event)
        if parts[0].device.type == "cpu" and self.native:
            # the native service copies at once with copy_: gathering straight into the destinations is that copy
            # without the temporary (one index_select per part and run)
            index = torch.tensor(blocks, dtype=torch.long)
            self.num_calls += 1
            for first, n, regions in runs:
                self.num_transfers += len(regions)
                for p, dst in zip(parts, regions):
                    torch.index_select(p, 0, index[first: first + n], out=dst)
            self.num_to_host += len(blocks)
            return None
        index = to_device(torch.tensor(blocks, dtype=torch.long), parts[0].device)
        gathered = [p.index_select(0, index) for p in parts]
        dsts, srcs = [], []
        for first, n, regions in runs:
            dsts.extend(regions)
            srcs.extend(g[first: first + n] for g in gathered)
        event = self._copy(dsts, srcs)
        self.num_to_host += len(blocks)
        if event is None:
            return None
        self.down.append((event, gathered))
        backend = self.backend
        return lambda: backend.event_synchronize(event)

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
        """Make the compute stream wait for every copy up queued since the last fence (the collected ones are issued
        first), and release the gathers of copies down that are done; returns how many events it waited on."""
        self.flush()
        n = len(self.fences)
        for event in self.fences:
            self.backend.wait_event(event)
        self.fences.clear()
        if self.down:
            self.down = [(e, g) for e, g in self.down if not self.backend.event_done(e)]
        return n
