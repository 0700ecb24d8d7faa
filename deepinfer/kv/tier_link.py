"""How the device pool of the prefix cache meets its lower tiers (host memory, then disk): evictions go down,
hits read back from the first tier that has the block.

Every device <-> host copy goes through kv/tier_copies.py (the backend's copy stream; the model runner's
launch makes the compute stream wait for the copies up, `fence`). So at schedule time:
- an allocation's evictions (one callback for all of them) reserve host slots and queue ONE batched copy down
  (tier_copies.to_host_batch) of a gather of the blocks made on the compute stream, and the blocks are handed
  out at once: the next step, which writes them, waits for neither the copy nor the host (the copy reads the
  gather, so it overlaps that step on the device);
- a hit in the host tier queues the copies up into the new blocks right away (prefetch), and the step that
  reads them waits for them on the device;
- a hit on disk starts the file reads on the disk tier's thread pool; until they are done the sequence is not
  admitted (the scheduler serves the others meanwhile, `extend(..., wait=False)`), unless nothing else can
  run, when the host waits for them (it has nothing else to do).

Several groups (V4's hybrid cache): every group's pool evicts into the same tiers, under a key tagged with the
group's name (`tier_key`: a compressed block and a window block can carry the same token key). The window
group's block io also carries the block's compressor-state snapshot (state_snapshots.py), so a window block and
the snapshot beside it travel together. One group (V2 / V3) keeps the untagged key (files already on disk stay
valid).
"""

from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future
from typing import Callable

import torch

from deepinfer.kv.host_tier import SlotRef
from deepinfer.kv.prefix_cache import CachingBlockPool
from deepinfer.kv.tier_copies import TierCopies

_READS_KEPT = 4096  # disk reads started for sequences not admitted yet (older ones are dropped past this)


class TierLink:
    """host: host_tier.HostTier or None; disk: disk_tier.DiskTier or None (at least one); ios: per group, a
    worker/kv_block_io.KVBlockIO (one block's KV across the group's layers); pools: the groups' CachingBlockPools,
    whose evictions now go to the host tier (whose own evictions go to disk), or straight to disk without a host
    tier; copies: the backend's copy services (tier_copies.TierCopies)."""

    def __init__(self, host, disk, ios: dict, pools: dict[str, CachingBlockPool], copies: TierCopies):
        if host is None and disk is None:
            raise ValueError("a tier link needs a host or a disk tier")
        if set(ios) != set(pools):
            raise ValueError(f"a tier link needs one block io per group: {sorted(ios)} vs {sorted(pools)}")
        self.host, self.disk, self.ios, self.pools, self.copies = host, disk, ios, pools, copies
        self.tagged = len(pools) > 1
        self.tiers = [t for t in (host, disk) if t is not None]
        self._reads: dict[bytes, Future] = {}  # disk reads in flight or done, not yet consumed
        self.num_deferred = 0  # admissions put off until their disk reads finish
        self.num_spilled = 0  # evicted blocks sent to disk past a host tier with no free slot (writer behind)
        self.timings: dict[str, float] | None = None  # set to {} to sum seconds per eviction phase (benchmarks)
        if disk is not None:
            disk.use_allocator(copies.alloc)
        self.carve_host()
        for group, pool in pools.items():
            pool.on_evict = self._evictor(group)

    def carve_host(self) -> None:
        """The host tier's whole pool, at start-up: evictions never allocate host memory after this. Slots are
        sized from the block ios, so this runs again (on an empty tier) when one grows (V4's snapshot slots)."""
        if self.host is None:
            return
        layouts = {g: [(t.dtype, tuple(t.shape)) for t in io.like()] for g, io in self.ios.items()}
        weights = {g: self.pools[g].num_blocks * sum(t.numel() * t.element_size() for t in io.like())
                   for g, io in self.ios.items()}
        self.host.carve(layouts, weights, self.copies.backend.host_buffer, with_disk=self.disk is not None)

    @property
    def block_io(self):
        """The one group's block io (V2 / V3)."""
        (io,) = self.ios.values()
        return io

    @property
    def pool(self) -> CachingBlockPool:
        (pool,) = self.pools.values()
        return pool

    def tier_key(self, group: str, key: bytes) -> bytes:
        return hashlib.sha256(key + b"|" + group.encode()).digest() if self.tagged else key

    def _evictor(self, group: str) -> Callable[[list[int], list[bytes]], None]:
        return lambda blocks, keys: self._evicted(group, blocks, keys)

    def _evicted(self, group: str, blocks: list[int], keys: list[bytes]) -> None:
        """One allocation's evicted blocks (before any is reused): the keys are tagged once, the blocks already
        in a tier skipped, host slots reserved, then ONE copy_async call moves them all (a gather per cache
        part, a transfer per part and run of slots). Blocks no host slot can take go straight to disk."""
        t0 = time.perf_counter()
        if self.tagged:
            keys = [self.tier_key(group, k) for k in keys]
        new = [i for i, k in enumerate(keys) if not any(t.contains(k) for t in self.tiers)]
        if not new:
            return
        blocks, keys = [blocks[i] for i in new], [keys[i] for i in new]
        t1 = time.perf_counter()
        slots: list[int] = []
        if self.host is not None:
            to_disk = None if self.disk is None else (lambda k: not self.disk.contains(k))
            slots, pushed = self.host.reserve(group, len(blocks), to_disk)
            for old_key, old, old_ready, release in pushed:
                self.disk.put(old_key, old, old_ready, release)
        t2 = time.perf_counter()
        io, n = self.ios[group], len(slots)
        runs = self.host.pool.runs(group, slots) if n else []
        spill = None
        if n < len(blocks) and self.disk is None:  # every slot lent to a hit: these blocks are not kept
            self.host.dropped += len(blocks) - n
        if n < len(blocks) and self.disk is not None:  # no host tier, or no free slot: staging buffers for disk
            spill = [self.copies.alloc((len(blocks) - n, *p.shape[1:]), p.dtype) for p in io.parts]
            runs.append((n, len(blocks) - n, spill))
        t3 = time.perf_counter()
        gathered = blocks if spill is not None else blocks[:n]  # without a disk, blocks beyond the slots are dropped
        ready = self.copies.to_host_batch(io.parts, gathered, runs) if runs else None
        t4 = time.perf_counter()
        if n:
            self.host.commit(group, keys[:n], slots, ready)
        if spill is not None:
            self.num_spilled += len(blocks) - n
            for i, key in enumerate(keys[n:]):
                self.disk.put(key, [buf[i] for buf in spill], ready)
        if self.timings is not None:
            t5 = time.perf_counter()
            for phase, dt in (("keys", t1 - t0), ("reserve", t2 - t1), ("runs", t3 - t2), ("copy", t4 - t3),
                              ("commit", t5 - t4)):
                self.timings[phase] = self.timings.get(phase, 0.0) + dt

    def contains(self, group: str, key: bytes) -> bool:
        key = self.tier_key(group, key)
        return any(t.contains(key) for t in self.tiers)

    def fetch(self, group: str, key: bytes, wait: bool = True, lend: bool = False
              ) -> tuple[list[torch.Tensor] | SlotRef | None, bool]:
        """One block's payload from the host tier, else from disk: (payload or None on a miss / a bad file,
        ready). ready is False when wait is False and the disk read is still running (ask again later).
        lend: a host-tier block comes as its SlotRef (what `load` copies up in runs), not as views."""
        key, like = self.tier_key(group, key), self.ios[group].like()
        got = None
        if self.host is not None:
            got = self.host.lend(key) if lend and self.host.fits(group, like) else self.host.get(key, like)
        if got is not None or self.disk is None:
            return got, True
        read = self._reads.get(key)
        if read is None:
            if not self.disk.contains(key):
                return None, True
            read = self._reads[key] = self.disk.read_async(key, like)
        if not wait and not read.done():
            return None, False
        return self._reads.pop(key).result(), True

    def extend(self, depth: int, limit: int, key_at: Callable[[int], bytes], keys: list[bytes],
               parts: list[list[torch.Tensor]], wait: bool = True) -> tuple[int, bool]:
        """One group: past a device hit of `depth` blocks, up to `limit`: the blocks the tiers hold, into keys /
        parts. Host blocks are taken at once; blocks on disk are read on the disk tier's pool. Returns (new depth,
        ready): ready is False when wait is False and a read is still running (keys / parts then stop before
        it; ask again later). A file failing its checks ends the hit there. A host-tier block comes as its SlotRef
        (no views: `load` copies it up in runs of slots)."""
        like = self.block_io.like()
        (group,) = self.ios  # V2 / V3: one group
        host = self.host if self.host is not None and self.host.fits(group, like) else None
        while depth < limit:
            key = key_at(depth)
            got = host.lend(key) if host is not None else None
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

    def start_reads(self, group: str, keys: list[bytes]) -> None:
        """Start the disk reads of these blocks of `group` (those on disk, not in host memory), in parallel."""
        if self.disk is None:
            return
        like = self.ios[group].like()
        for key in keys:
            key = self.tier_key(group, key)
            if key in self._reads or (self.host is not None and self.host.contains(key)):
                continue
            if self.disk.contains(key):
                self._reads[key] = self.disk.read_async(key, like)

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

    def load(self, blocks, keys: list[bytes], parts: list, group: str | None = None, flush: bool = True) -> list[int]:
        """Queue the copies of read-back payloads into freshly allocated device blocks of `group` (default: the one
        group) and key them there (the next step waits for the copies: `fence`); flush: issue them now (one
        copy_async call for everything queued). Returns the device block each key landed in, in keys' order: the
        caller's table entries take them.

        parts[i]: a host-tier block's SlotRef, or a payload (a list of host tensors: disk reads, tests). The fresh
        blocks are interchangeable (the hit's own, unkeyed), so host-tier blocks are placed in slot order on the
        fresh blocks in ascending order: consecutive slots land in consecutive blocks and a run of them is one
        transfer per cache part, straight from the pool's regions (an 8k hit on a GPU: one per layer, not one per
        block and layer). Payloads whose blocks are consecutive go in one copy per cache part, staged in one host
        buffer where copies are synchronous (`_queue_run`)."""
        io = self.block_io if group is None else self.ios[group]
        pool = self.pool if group is None else self.pools[group]
        placed = [int(b) for b in blocks]
        lent = [i for i, p in enumerate(parts) if isinstance(p, SlotRef)]
        if lent:
            fresh = sorted(placed)
            lent.sort(key=lambda i: parts[i].slot)
            others = [i for i, p in enumerate(parts) if not isinstance(p, SlotRef)]
            for i, b in zip(lent + others, fresh):
                placed[i] = b
            self._queue_slot_runs(io, [(parts[i], placed[i]) for i in lent])
        order = sorted((i for i, p in enumerate(parts) if not isinstance(p, SlotRef)), key=lambda i: placed[i])
        run: list[int] = []
        for i in order + [None]:
            if run and (i is None or placed[i] != placed[run[-1]] + 1):
                self._queue_run(io, placed[run[0]], [parts[j] for j in run])
                run = []
            if i is not None:
                io.check(parts[i])
                run.append(i)
        for block, key in zip(placed, keys):
            pool.register(block, key)
        if flush:
            self.copies.flush()
        return placed

    def _queue_slot_runs(self, io, pairs: list[tuple[SlotRef, int]]) -> None:
        """(slot, device block) pairs in ascending slot order: one (dst, src) per cache part and run of consecutive
        slots landing in consecutive blocks. The sources are rows of the pool's regions: a slot still filling behind
        its copy down is covered by the copy stream's order (both copies run on it)."""
        start = 0
        for k in range(1, len(pairs) + 1):
            ref, block = pairs[k - 1]
            if k < len(pairs) and pairs[k][0].slot == ref.slot + 1 and pairs[k][1] == block + 1 \
                    and pairs[k][0].group == ref.group:
                continue
            (first, b), n = pairs[start], k - start
            regions = self.host.pool.groups[first.group].regions
            self.copies.queue_to_device(io.range_views(b, n), [r[first.slot: first.slot + n] for r in regions],
                                        blocks=n)
            start = k

    def _queue_run(self, io, first: int, payloads: list[list[torch.Tensor]]) -> None:
        """Payloads of blocks first, first + 1, ...: one (dst, src) per cache part (a host staging buffer when
        there are several). Staging reads the payloads on the host, so it runs only where copies are synchronous
        (no copy stream, the cpu backend): on a GPU a host-tier payload may still be filling behind its copy down's
        event, which only the copy stream's order covers; there each block is its own transfer (still one call)."""
        if len(payloads) == 1 or self.copies.stream is not None:
            for k, payload in enumerate(payloads):
                self.copies.queue_to_device(io.views(first + k), payload, blocks=1)
            return
        srcs = [torch.stack([payload[p] for payload in payloads]) for p in range(len(payloads[0]))]  # plain memory
        self.copies.queue_to_device(io.range_views(first, len(payloads)), srcs, blocks=len(payloads))

    def loaded(self) -> None:
        """A hit's copies up are queued: issue them, and let the host slots they read be pushed out again (later
        fills of those slots queue behind these copies)."""
        self.copies.flush()
        if self.host is not None:
            self.host.release_lent()

    def fence(self) -> int:
        """Before a step is launched: the compute stream waits for the copies queued since the last step (and a
        hit fetched but not attached, dropped by the scheduler, lends its host slots no longer)."""
        if self.host is not None:
            self.host.release_lent()
        return self.copies.fence()
