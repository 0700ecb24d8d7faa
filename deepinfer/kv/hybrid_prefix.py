"""Prefix caching over a hybrid KV cache (V4): which block of which group a token-block key names, and
which keys a hit of d blocks needs.

Keys are the V2 / V3 ones: key i = the chained hash of token blocks 0..i (prefix_cache.block_key). For a
prefix of L = d * block_size tokens:
- one-entry-per-token groups (the sliding window; a full group too): block i holds tokens of block i and
  is keyed with key i. A sliding-window group needs only the blocks still in the window at L,
  [first_live_entry(L) // block_size, d); the older ones may have been evicted;
- a compressed group (m tokens per entry): block j holds entries [j * bs, (j + 1) * bs), i.e. tokens
  [j * bs * m, (j + 1) * bs * m), so it is complete, and keyed with key (j + 1) * m - 1, when that token
  block is. A hit of d needs its complete blocks j < d // m; the partly filled one (d // m when L // m is
  not a multiple of bs) is never shared: the hit gets a fresh block and its entries are restored from the
  snapshot (state_snapshots.py), as is the compressor ring.
The snapshot of boundary L lives beside the sliding-window block d - 1, which every hit attaches.
"""

from __future__ import annotations

from typing import Callable

from deepinfer.backend import KVCacheSpec


def is_hybrid(specs: list[KVCacheSpec]) -> bool:
    """Whether a cache needs this module's rules (any group that is not full attention)."""
    return any(s.sliding_window is not None or s.tokens_per_entry != 1 or s.state_shape for s in specs)


def window_group(specs: list[KVCacheSpec]) -> str | None:
    """The sliding-window group whose blocks carry the state snapshots (prefix_caching_refusals: at most one)."""
    return next((s.name for s in specs if s.sliding_window is not None), None)


TIER = -2  # a table entry of a hit whose block is in a lower tier (host memory, disk): a fresh block reads it back


def match_hybrid(specs: list[KVCacheSpec], find: Callable[[str, bytes], int | None], block_size: int, limit: int,
                 key_at: Callable[[int], bytes], dead_blocks: Callable[[KVCacheSpec, int], int]
                 ) -> tuple[int, dict[str, list[int]]]:
    """(d, per-group blocks): the deepest d <= limit whose needed blocks are all cached, or (0, {}).
    find(group, key): the device block keyed so, TIER where only a lower tier holds it, or None.

    The compressed groups' condition shrinks with d (their blocks chain from block 0), so it bounds d
    first; the window's blocks are checked from that bound down, since an older window may have been
    evicted while a newer one was kept, or the other way round."""
    comp: dict[str, list[int]] = {}
    for s in specs:
        m = s.tokens_per_entry
        if m == 1:
            continue
        got: list[int] = []
        while (len(got) + 1) * m <= limit:
            b = find(s.name, key_at((len(got) + 1) * m - 1))
            if b is None:
                break
            got.append(b)
        limit = min(limit, (len(got) + 1) * m - 1)  # d // m <= len(got)
        comp[s.name] = got
    for d in range(limit, 0, -1):
        found: dict[str, list[int]] = {}
        for s in specs:
            if s.tokens_per_entry != 1:
                found[s.name] = comp[s.name][: d // s.tokens_per_entry]
                continue
            lo = dead_blocks(s, d * block_size)
            ids = [find(s.name, key_at(i)) for i in range(lo, d)]
            if any(b is None for b in ids):
                break
            found[s.name] = [-1] * lo + ids
        else:
            return d, found
    return 0, {}


def register_hybrid(specs: list[KVCacheSpec], pools: dict, tables: dict, row: int, start: int, end: int,
                    keys: list[bytes]) -> None:
    """Key the blocks that token blocks [start, end) complete, in every group, for the sequence at `row`."""
    for i in range(start, end):
        for s in specs:
            m = s.tokens_per_entry
            if m == 1:
                b = int(tables[s.name][row, i])
            elif (i + 1) % m == 0:
                b = int(tables[s.name][row, (i + 1) // m - 1])
            else:
                continue
            if b >= 0:  # a window block already returned (its tokens were never keyed): nothing to key
                pools[s.name].register(b, keys[i])
