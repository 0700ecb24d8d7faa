"""How the device pool of the prefix cache meets its lower tiers (host memory, then disk): evictions go down,
hits read back from the first tier that has the block.

Every device <-> host copy goes through kv/tier_copies.py (the backend's copy stream; the model runner's
launch makes the compute stream wait for them, `fence`). So at schedule time:
- an eviction queues its block's copy down and the block is handed out at once: the next step, which writes
  it, waits for the copy on the device, not the host;
- a hit in the host tier queues the copies up into the new blocks right away (prefetch), and the step that
  reads them waits for them on the device;
- a hit on disk starts the file reads on the disk tier's thread pool; until they are done the sequence is not
  admitted (the scheduler serves the others meanwhile, `extend(..., wait=False)`), unless nothing else can
  run, when the host waits for them (it has nothing else to do).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Callable

import torch

from deepinfer.kv.prefix_cache import CachingBlockPool
from deepinfer.kv.tier_copies import TierCopies

_READS_KEPT = 4096  # disk reads started for sequences not admitted yet (older ones are dropped past this)


class TierLink:
    """host: host_tier.HostTier or None; disk: disk_tier.DiskTier or None (at least one); block_io:
    worker/kv_block_io.KVBlockIO (one block's KV across the group's layers); pool: the group's
    CachingBlockPool, whose evictions now go to the host tier (whose own evictions go to disk), or
    straight to disk without a host tier; copies: the backend's copy services (tier_copies.TierCopies)."""

    def __init__(self, host, disk, block_io, pool: CachingBlockPool, copies: TierCopies):
        if host is None and disk is None:
            raise ValueError("a tier link needs a host or a disk tier")
        self.host, self.disk, self.block_io, self.pool, self.copies = host, disk, block_io, pool, copies
        self.tiers = [t for t in (host, disk) if t is not None]
        self._reads: dict[bytes, Future] = {}  # disk reads in flight or done, not yet consumed
        self.num_deferred = 0  # admissions put off until their disk reads finish
        if disk is not None:
            disk.use_allocator(copies.alloc)
        pool.on_evict = self._evicted

    def _evicted(self, block: int, key: bytes) -> None:
        if any(t.contains(key) for t in self.tiers):
            return
        parts, ready = self.copies.to_host(self.block_io.views(block))
        if self.host is None:
            self.disk.put(key, parts, ready)
            return
        for old_key, old, old_ready in self.host.put(key, parts, ready):
            if self.disk is not None and not self.disk.contains(old_key):
                self.disk.put(old_key, old, old_ready)

    def extend(self, depth: int, limit: int, key_at: Callable[[int], bytes], keys: list[bytes],
               parts: list[list[torch.Tensor]], wait: bool = True) -> tuple[int, bool]:
        """Past a device hit of `depth` blocks, up to `limit`: the blocks the tiers hold, into keys / parts.
        Host blocks are taken at once; blocks on disk are read on the disk tier's pool. Returns (new depth,
        ready): ready is False when wait is False and a read is still running (keys / parts then stop before
        it; ask again later). A file failing its checks ends the hit there."""
        like = self.block_io.like()
        while depth < limit:
            key = key_at(depth)
            got = self.host.get(key, like) if self.host is not None else None
            if got is None and self.disk is not None:
                read = self._reads.get(key)
                if read is None and self.disk.contains(key):
                    read = self._start_reads(depth, limit, key_at, like)
                if read is not None:
                    if not wait and not read.done():
                        self.num_deferred += 1
                        return depth, False
                    got = self._reads.pop(key).result()
            if got is None:
                break
            keys.append(key)
            parts.append(got)
            depth += 1
        return depth, True

    def _start_reads(self, depth: int, limit: int, key_at: Callable[[int], bytes], like) -> Future:
        """Start reading this block and the following ones the disk holds (they are read in parallel)."""
        if len(self._reads) > _READS_KEPT:
            self._reads.clear()
        first = None
        for d in range(depth, limit):
            key = key_at(d)
            if key in self._reads:
                continue
            if not self.disk.contains(key):
                break
            self._reads[key] = self.disk.read_async(key, like)
            first = first or self._reads[key]
        return first

    def load(self, blocks, keys: list[bytes], parts: list[list[torch.Tensor]]) -> None:
        """Queue the copies of read-back payloads into freshly allocated device blocks and key them there (the
        next step waits for the copies: `fence`)."""
        for block, key, payload in zip(blocks, keys, parts):
            self.block_io.check(payload)
            self.copies.to_device(self.block_io.views(int(block)), payload)
            self.pool.register(int(block), key)

    def fence(self) -> int:
        """Before a step is launched: the compute stream waits for the copies queued since the last step."""
        return self.copies.fence()

    def idle(self) -> None:
        """The engine has nothing running: let queued disk writes finish (nothing waits on the host now)."""
        if self.disk is not None:
            self.disk.flush()
