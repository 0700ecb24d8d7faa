"""Prefix caching: full KV blocks keyed by a chained hash, shared by reference count, evicted LRU leaf first.

Key of block k of a sequence = sha256(key of block k-1 || the block's token ids || the cache salt). The salt
holds everything else that changes the KV: the model fingerprint (config.json), the dtype, the block size.
Because the key chains, a key fixes the whole prefix up to the block's end, not just the block's own
tokens. Only full blocks whose tokens are all computed and known on the host are keyed.

A block is in one of three states:
- used: held by one or more sequences (ref > 0);
- cached: ref 0 and still keyed, so it can be reused by a hit or evicted when a block is needed;
- free: ref 0, no key.

Allocation takes free blocks first and then evicts cached ones, least recently freed first. A sequence
frees its blocks last block first, so within a prefix the leaf goes before its parents, and a parent
outlives every block that needs it.

Full-attention groups (V2 / V3) share a block per key. V4's hybrid cache (sliding window, compressed groups,
compressor state) keys its blocks with the same token keys; hybrid_prefix.py says which block of which group
a key names, and state_snapshots.py keeps the compressor state at block boundaries (docs/kv-cache.md, "V4").
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from deepinfer.backend import KVCacheSpec
from deepinfer.errors import DeepInferError
from deepinfer.kv.block_pool import BlockPool


def block_key(parent: bytes, tokens, salt: bytes) -> bytes:
    """The chained key of one full block (tokens: a list or an int64 array)."""
    h = hashlib.sha256(parent)
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    h.update(salt)
    return h.digest()


def chain_keys(parent: bytes, tokens, block_size: int, salt: bytes) -> list[bytes]:
    """The chained keys of consecutive full blocks of `tokens` (a list or an int64 array whose length is a
    multiple of block_size), the first chained to `parent`: block_key's bytes exactly (so disk-tier files
    keep their names), but one array conversion for all the blocks instead of one per block, and each block's
    bytes hashed as a slice of one buffer. At 8k tokens this is what a prefix hit spends hashing."""
    buf = memoryview(np.ascontiguousarray(tokens, dtype=np.int64).tobytes())
    step = block_size * 8
    if len(buf) % step:
        raise DeepInferError(f"chain_keys: {len(buf) // 8} tokens are not whole blocks of {block_size}")
    out, sha = [], hashlib.sha256
    for off in range(0, len(buf), step):
        h = sha(parent)
        h.update(buf[off: off + step])
        h.update(salt)
        parent = h.digest()
        out.append(parent)
    return out


class CachingBlockPool(BlockPool):
    """A BlockPool whose freed full blocks stay findable by key until a new allocation evicts them."""

    def __init__(self, num_blocks: int, name: str = ""):
        super().__init__(num_blocks, name)
        self.ref = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self.num_evictions = 0
        self.on_evict = None  # (blocks, keys) -> None: one allocation's evictions, before any is reused (lower tiers)

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones it may evict."""
        return len(self._free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.block_of)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise DeepInferError(f"KV group {self.name!r}: asked for {n} blocks, {self.num_free} free")
        out, evicted, keys = [], [], []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                key = self.key_of.pop(b)
                del self.block_of[key]
                evicted.append(b)
                keys.append(key)
            self.ref[b] = 1
            out.append(b)
        self.num_evictions += len(evicted)
        if evicted and self.on_evict is not None:  # one call for the whole allocation: the tiers batch its copies
            self.on_evict(evicted, keys)
        return out

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block, last first (leaf before parent in the LRU order)."""
        for b in reversed(blocks):
            if b < 0:
                continue
            if self.ref[b] <= 0:
                raise DeepInferError(f"KV group {self.name!r}: block {b} freed twice or never allocated")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.key_of:
                    self.evictable[b] = None
                else:
                    self._free.append(b)

    def lookup(self, keys: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (no side effects)."""
        out = []
        for k in keys:
            b = self.block_of.get(k)
            if b is None:
                break
            out.append(b)
        return out

    def take(self, blocks: list[int]) -> None:
        """Add a reference to each (a sequence attaches a cached prefix)."""
        for b in blocks:
            if b < 0:  # a sliding-window entry below the window: nothing attached
                continue
            if self.ref[b] == 0:
                self.evictable.pop(b)
            self.ref[b] += 1

    def num_reclaimed_by(self, blocks: list[int]) -> int:
        """How many of `blocks` an attach would take out of the evictable set (they stop counting as free)."""
        return sum(1 for b in blocks if b >= 0 and self.ref[b] == 0)

    def register(self, block: int, key: bytes) -> None:
        """Key a full, computed block. A key already cached under another block keeps that one (two
        sequences that computed the same prefix at once); this block then stays unkeyed."""
        if self.ref[block] <= 0:
            raise DeepInferError(f"KV group {self.name!r}: registering block {block}, which nobody holds")
        if key in self.block_of or block in self.key_of:
            return
        self.block_of[key] = block
        self.key_of[block] = key

    def check(self) -> None:
        """Raise unless every block is in exactly one state and the key maps agree (tests call it)."""
        free = set(self._free)
        ev = set(self.evictable)
        used = {b for b in range(self.num_blocks) if self.ref[b] > 0}
        if free & ev or free & used or ev & used or len(free) + len(ev) + len(used) != self.num_blocks:
            raise DeepInferError(f"KV group {self.name!r}: block states overlap or leak")
        if len(free) != len(self._free) or any(b not in self.key_of for b in ev):
            raise DeepInferError(f"KV group {self.name!r}: a free block is listed twice or a cached one has no key")
        if any(self.block_of[k] != b for b, k in self.key_of.items()) or len(self.block_of) != len(self.key_of):
            raise DeepInferError(f"KV group {self.name!r}: key maps disagree")


def prefix_caching_refusals(specs: list[KVCacheSpec]) -> list[str]:
    """Why prefix caching cannot serve these KV groups (empty: it can).

    Full groups are always served. A hybrid cache (V4) is served when its compressed and stateful groups
    hang off exactly one sliding-window group of one token per entry: that group's blocks carry the
    compressor-state snapshots (state_snapshots.py), so every hit needs its window blocks anyway."""
    out = []
    windows = [s for s in specs if s.sliding_window is not None]
    for s in windows:
        if s.tokens_per_entry != 1:
            out.append(f"group {s.name!r} is a compressed sliding window ({s.tokens_per_entry} tokens per entry): "
                       "its blocks do not follow the token blocks")
        elif s.sliding_window < 2:
            out.append(f"group {s.name!r} has a sliding window of {s.sliding_window} token (it must be >= 2, so a "
                       "hit's last block is in the window and carries the state snapshot)")
    for s in specs:
        if s.state_shape and s.tokens_per_entry == 1:
            out.append(f"group {s.name!r} carries per-sequence state without compression: only compressor rings "
                       "are snapshotted at block boundaries")
    if any(s.state_shape or s.tokens_per_entry != 1 for s in specs if s.sliding_window is None) and len(windows) != 1:
        out.append(f"compressed / stateful groups need exactly one sliding-window group to hold their state "
                   f"snapshots, this model has {len(windows)}")
    return out
