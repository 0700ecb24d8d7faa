"""How the device pool of the prefix cache meets its lower tiers (host memory, then disk): evictions go down,
hits read back from the first tier that has the block."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.kv.prefix_cache import CachingBlockPool


class TierLink:
    """host: host_tier.HostTier or None; disk: disk_tier.DiskTier or None (at least one); block_io:
    worker/kv_block_io.KVBlockIO (one block's KV across the group's layers); pool: the group's
    CachingBlockPool, whose evictions now go to the host tier (whose own evictions go to disk), or
    straight to disk without a host tier."""

    def __init__(self, host, disk, block_io, pool: CachingBlockPool):
        if host is None and disk is None:
            raise ValueError("a tier link needs a host or a disk tier")
        self.host, self.disk, self.block_io, self.pool = host, disk, block_io, pool
        self.tiers = [t for t in (host, disk) if t is not None]
        pool.on_evict = self._evicted

    def _evicted(self, block: int, key: bytes) -> None:
        if any(t.contains(key) for t in self.tiers):
            return
        parts = self.block_io.read(block)
        if self.host is None:
            self.disk.put(key, parts)
            return
        for old_key, old in self.host.put(key, parts):
            if self.disk is not None and not self.disk.contains(old_key):
                self.disk.put(old_key, old)

    def extend(self, depth: int, limit: int, key_at: Callable[[int], bytes], keys: list[bytes],
               parts: list[list[torch.Tensor]]) -> int:
        """Past a device hit of `depth` blocks, up to `limit`: the blocks the tier holds, read now (schedule
        time, before the step that needs them) into keys / parts; a file failing its checks ends the hit.
        Returns the new depth."""
        like = self.block_io.like()
        while depth < limit:
            key = key_at(depth)
            got = None
            for tier in self.tiers:
                got = tier.get(key, like)
                if got is not None:
                    break
            if got is None:
                break
            keys.append(key)
            parts.append(got)
            depth += 1
        return depth

    def load(self, blocks, keys: list[bytes], parts: list[list[torch.Tensor]]) -> None:
        """Write read-back payloads into freshly allocated device blocks and key them there."""
        for block, key, payload in zip(blocks, keys, parts):
            self.block_io.write(int(block), payload)
            self.pool.register(int(block), key)
