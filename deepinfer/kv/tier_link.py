"""How the device pool of the prefix cache meets its disk tier: evictions write files, hits read them back."""

from __future__ import annotations

from typing import Callable

import torch

from deepinfer.kv.prefix_cache import CachingBlockPool


class DiskTierLink:
    """tier: disk_tier.DiskTier; block_io: worker/kv_block_io.KVBlockIO (one block's KV across the group's
    layers); pool: the group's CachingBlockPool, whose evictions now go to the tier first."""

    def __init__(self, tier, block_io, pool: CachingBlockPool):
        self.tier, self.block_io, self.pool = tier, block_io, pool
        pool.on_evict = self._evicted

    def _evicted(self, block: int, key: bytes) -> None:
        if not self.tier.contains(key):
            self.tier.put(key, self.block_io.read(block))

    def extend(self, depth: int, limit: int, key_at: Callable[[int], bytes], keys: list[bytes],
               parts: list[list[torch.Tensor]]) -> int:
        """Past a device hit of `depth` blocks, up to `limit`: the blocks the tier holds, read now (schedule
        time, before the step that needs them) into keys / parts; a file failing its checks ends the hit.
        Returns the new depth."""
        like = self.block_io.like()
        while depth < limit:
            key = key_at(depth)
            got = self.tier.get(key, like)
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
