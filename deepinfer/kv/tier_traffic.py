"""The lower tiers' half of KVCacheManager: attaching the host / disk tiers, and reading a hit's blocks back from
them into fresh device blocks.

A mixin of manager.KVCacheManager. The link (tier_link.py) does the copies; this file decides which table
entries they fill. V2 / V3: the tier blocks continue the device hit, so they fill the table right after it. V4's
hybrid cache: any entry of the hit may come from a tier (an older window block kept on the device while a newer
one was evicted, or the reverse), so `match_hybrid` marks them TIER, the payloads are fetched at match time
(`_fetch_tier_blocks`), and at attach each gets a fresh block, its payload and its key. A window block's payload
carries its compressor-state snapshot slot too, so the hit's snapshot comes back with it.
"""

from __future__ import annotations

from typing import Callable

from deepinfer.errors import DeepInferError
from deepinfer.kv.hybrid_prefix import TIER
from deepinfer.kv.tier_copies import TierCopies
from deepinfer.kv.tier_link import TierLink


class TierTraffic:
    """attach_tiers / fence_tier_copies and the hit's read-backs (KVCacheManager's)."""

    def attach_tiers(self, host, disk, block_io) -> None:
        """Evicted keyed blocks go to the host tier (host_tier.HostTier), from there to disk
        (disk_tier.DiskTier); hits continue into them (tier_link.py). Either may be None. block_io: a
        worker/kv_block_io.KVBlockIO, or one per group {group: KVBlockIO} (V4). The copies run on the backend's
        copy stream (tier_copies.py), so use_backend must have been called. On V4 the window group's block io
        gets the state snapshot slots (attach_state_snapshots, before or after this)."""
        if not self.prefix_caching:
            raise DeepInferError("the host / disk tiers need prefix caching")
        if self.backend is None:
            raise DeepInferError("the host / disk tiers copy through the backend: call use_backend first "
                                 "(the model runner does, for a model that holds its backend)")
        ios = block_io if isinstance(block_io, dict) else {self.specs[0].name: block_io}
        if set(ios) != {s.name for s in self.specs}:
            raise DeepInferError(f"the host / disk tiers need one block io per KV group {[s.name for s in self.specs]}"
                                 f", got {sorted(ios)}")
        self.host_tier, self.disk_tier = host, disk
        if self.snapshots is not None:  # before the link sizes the host pool's slots from the block ios
            ios[self.window_group].add_parts(self.snapshots.slot_tensors())
        self._tier = TierLink(host, disk, ios, self.pools, TierCopies(self.backend))

    def fence_tier_copies(self) -> None:
        """Before a step is launched: its compute waits (on the device) for the tiers' copies queued so far."""
        if self._tier is not None:
            self._tier.fence()

    def _load_tier_blocks(self, sb, prefix) -> None:
        """V2 / V3: the tier blocks fill the table entries right after the device hit."""
        group = self.specs[0].name
        first = len(prefix.blocks[group])
        entries = self._np[group][sb.row, first: first + len(prefix.tier_keys)]  # fresh blocks, just allocated
        entries[:] = self._tier.load(entries, prefix.tier_keys, prefix.tier_parts)  # placed in slot order
        sb.num_keyed = first + len(prefix.tier_keys)
        self.prefix_tier_hit_tokens += len(prefix.tier_keys) * self.block_size

    # ------------------------------------------------------------ hybrid caches (V4)

    def _find(self, group: str, key: bytes, missing: set) -> int | None:
        """The device block keyed `key` in `group`, TIER where only a lower tier has it, else None."""
        b = self.pools[group].block_of.get(key)
        if b is not None:
            return b
        if self._tier is not None and (group, key) not in missing and self._tier.contains(group, key):
            return TIER
        return None

    def _fetch_tier_blocks(self, hit, key_at: Callable[[int], bytes], missing: set, wait: bool) -> tuple[bool, bool]:
        """Read the payloads of the hit's TIER entries into hit.loads. Returns (ok, ready): ok False when a read
        failed (its block is added to `missing`: match again); ready False when wait is False and disk reads are
        still running (they were all started, in parallel)."""
        todo = []
        for s in self.specs:
            m = s.tokens_per_entry
            for j, b in enumerate(hit.blocks[s.name]):
                if b == TIER:  # entry j of a compressed group is keyed by token block (j + 1) * m - 1
                    todo.append((s.name, j, key_at((j + 1) * m - 1) if m > 1 else key_at(j)))
        if not wait:
            for group in {g for g, _, _ in todo}:
                self._tier.start_reads(group, [k for g, _, k in todo if g == group])
        ok = True
        for group, j, key in todo:
            payload, ready = self._tier.fetch(group, key, wait, lend=True)
            if not ready:
                self._tier.num_deferred += 1
                return False, False
            if payload is None:
                missing.add((group, key))
                ok = False
            else:
                hit.loads.append((group, j, key, payload))
        return ok, True

    def _load_hybrid_tier_blocks(self, sb, prefix) -> None:
        """At attach (the hit's device blocks are taken, so allocating cannot evict them): a fresh block for
        every TIER entry, its payload queued into it, its key registered."""
        by_group: dict[str, list] = {}
        for group, j, key, payload in prefix.loads:
            by_group.setdefault(group, []).append((j, key, payload))
        for group, items in by_group.items():
            fresh = self.pools[group].allocate(len(items))
            placed = self._tier.load(fresh, [k for _, k, _ in items], [p for _, _, p in items], group=group,
                                     flush=False)
            for (j, _, _), b in zip(items, placed):
                self._np[group][sb.row, j] = b
        self.prefix_tier_hit_tokens += sum(1 for g, _, _, _ in prefix.loads if g == self.window_group) * self.block_size
