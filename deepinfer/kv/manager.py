"""Paged KV cache bookkeeping across several KV groups (V3: one group; V4: a hybrid of several).

Each KVCacheSpec group gets its own BlockPool and each sequence a block table
per group. How many blocks a sequence needs follows from the spec alone:
  - full groups: ceil(entries / block_size), entries = tokens // tokens_per_entry
    (tokens_per_entry = 1 for ordinary attention, m for compressed groups);
  - sliding-window groups: the same table, but blocks wholly older than
    first_live_entry() go back to the pool and their table entries become -1;
  - groups with state_shape: one row of a slot pool of max_num_seqs rows per
    sequence (one row index shared by every such group).
Admission needs every group to fit, so accounting never drifts between groups.

With prefix caching (prefix_cache.py) a new or preempted sequence first attaches the cached blocks of its
longest keyed prefix and computes only the rest; its full, computed blocks are keyed as they fill
(`register_computed`), and freed keyed blocks stay findable until evicted. On V4's hybrid cache
(hybrid_prefix.py) a hit attaches the window's blocks and the compressed groups' complete blocks, and
restores the compressor state and the partly filled compressed blocks from state_snapshots.py.

This file keeps the tables and their growth, trim, rollback and free; the prefix-cache admission is in
prefix_admission.py and the lower tiers' traffic in tier_traffic.py (mixins of KVCacheManager).

Sliding windows keep `window_rollback_tokens` tokens beyond the window (default 0): what a sequence may be
rolled back by (speculative decoding rejecting drafts) and still hold the window of the position it returns
to. A V4 hit then asks for the same blocks (`dead_blocks` serves both).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from deepinfer.backend import KVCacheSpec
from deepinfer.errors import DeepInferError
from deepinfer.kv.block_pool import BlockPool, SlotPool
from deepinfer.kv.hybrid_prefix import TIER, is_hybrid, window_group
from deepinfer.kv.planner import window_blocks_per_seq
from deepinfer.kv.prefix_admission import PrefixAdmission, PrefixHit
from deepinfer.kv.prefix_cache import CachingBlockPool, prefix_caching_refusals
from deepinfer.kv.tier_link import TierLink
from deepinfer.kv.tier_traffic import TierTraffic

__all__ = ["KVCacheManager", "KVUser", "PrefixHit", "SeqBlocks"]


class KVUser(Protocol):
    """What the manager needs to know about a sequence."""

    seq_id: str
    num_computed_tokens: int


@dataclass
class SeqBlocks:
    """What the manager holds for one sequence; its block ids live in the manager's block_tables."""

    row: int  # its row in block_tables and in the per-sequence state pools
    num_blocks: dict[str, int]  # table entries per group (freed window entries count: they are -1)
    trimmed: dict[str, int]  # leading table entries already returned to the pool (sliding groups)
    num_tokens: int = 0  # tokens the tables cover
    room: int = 0  # most tokens the tables hold before any group needs another block
    num_keyed: int = 0  # leading full blocks already keyed in the prefix cache


class KVCacheManager(PrefixAdmission, TierTraffic):
    """Block tables and pools for all KV groups of one model.

    Each sequence holding blocks also holds a row (0..max_num_seqs-1): its index into the
    per-sequence state pools and into `block_tables`, one [max_num_seqs, width] int32 host
    tensor per group that is the only record of which blocks a sequence holds (-1: none / freed).
    A step's tables are one gather of its rows; single entries are read and written through a
    numpy view of the same memory (cheap scalar access, no second copy to keep in sync).
    """

    def __init__(
        self,
        specs: list[KVCacheSpec],
        num_blocks: dict[str, int],
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        prefix_caching: bool = False,
        cache_salt: bytes = b"",
        window_rollback_tokens: int = 0,
        state_rollback_tokens: int = 0,
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise DeepInferError(f"KV group names must be unique, got {names}")
        if isinstance(window_rollback_tokens, bool) or not isinstance(window_rollback_tokens, int) \
                or window_rollback_tokens < 0:
            raise DeepInferError(f"window_rollback_tokens must be an int >= 0, got {window_rollback_tokens!r}")
        if isinstance(state_rollback_tokens, bool) or not isinstance(state_rollback_tokens, int) \
                or state_rollback_tokens < 0:
            raise DeepInferError(f"state_rollback_tokens must be an int >= 0, got {state_rollback_tokens!r}")
        self.specs = list(specs)
        self.block_size = block_size
        self.window_rollback_tokens = window_rollback_tokens
        # tokens a sequence with per-sequence state may be rolled back by: the margin its rings were built with
        # (models/deepseek_v4/model.py v4_kv_cache_specs ring_margin), the caller's promise; 0: no rollback
        self.state_rollback_tokens = state_rollback_tokens
        self.max_model_len = max_model_len
        reasons = prefix_caching_refusals(specs) if prefix_caching else []
        if reasons:
            raise DeepInferError("prefix caching cannot run on this model: " + "; ".join(reasons))
        self.prefix_caching = prefix_caching
        self.cache_salt = cache_salt
        pool_cls = CachingBlockPool if prefix_caching else BlockPool
        self.pools = {s.name: pool_cls(num_blocks[s.name], s.name) for s in specs}
        self.prefix_queried_tokens = 0  # prompt tokens looked up at admission
        self.prefix_hit_tokens = 0  # of which served from the cache
        self.prefix_tier_hit_tokens = 0  # of which read back from a lower tier (host memory or disk)
        self.host_tier = None
        self.disk_tier = None
        self._tier: TierLink | None = None
        self.hybrid = prefix_caching and is_hybrid(specs)
        self.window_group = window_group(specs)
        self.snapshots = None  # state_snapshots.StateSnapshots, attached once the caches exist (stateful groups)
        self.backend = None  # whose copy services the lower tiers use (use_backend: the model runner's)
        self.slots = SlotPool(max_num_seqs, "rows")
        self.uses_state = any(s.state_shape for s in specs)
        self._has_windows = any(s.sliding_window is not None for s in specs)
        self.block_tables = {
            s.name: torch.full((max_num_seqs, max(1, self.table_len(s, max_model_len))), -1, dtype=torch.int32)
            for s in specs
        }
        self._np = {name: t.numpy() for name, t in self.block_tables.items()}
        self._seqs: dict[str, SeqBlocks] = {}
        # table entries written since the last take_table_changes(): group -> [(row, start, end)]
        self._changes: dict[str, list[tuple[int, int, int]]] = {s.name: [] for s in specs}

    # ------------------------------------------------------------ sizes

    def table_len(self, spec: KVCacheSpec, num_tokens: int) -> int:
        """Table entries needed once num_tokens tokens are cached."""
        return -(-(num_tokens // spec.tokens_per_entry) // self.block_size)

    def dead_blocks(self, spec: KVCacheSpec, num_tokens: int) -> int:
        """Leading table entries no longer needed when the next token is at position num_tokens: not read there,
        nor at any position a rollback of up to window_rollback_tokens tokens could return to."""
        if spec.sliding_window is None:
            return 0
        return spec.first_live_entry(max(0, num_tokens - self.window_rollback_tokens)) // self.block_size

    def fits_alone(self, num_tokens: int, chunk_tokens: int) -> list[str]:
        """Reasons a single sequence of num_tokens (computed in chunks of chunk_tokens) cannot fit."""
        reasons = []
        for s in self.specs:
            if s.sliding_window is None:
                need = self.table_len(s, num_tokens)
            else:
                need = min(self.table_len(s, num_tokens), window_blocks_per_seq(s, self.block_size, chunk_tokens,
                                                                                 self.window_rollback_tokens))
            if need > self.pools[s.name].num_blocks:
                reasons.append(f"group {s.name!r} needs {need} blocks, has {self.pools[s.name].num_blocks}")
        return reasons

    # ------------------------------------------------------------ per sequence

    def _new_blocks(self, sb: SeqBlocks | None, ctx: int, total: int) -> dict[str, int]:
        """Blocks each group must add (new minus window blocks freed first)."""
        out = {}
        for s in self.specs:
            held = sb.num_blocks[s.name] if sb else 0
            new = max(0, self.table_len(s, total) - held)
            if s.sliding_window is not None and sb is not None:
                dead = min(self.dead_blocks(s, ctx), held)
                new -= int((self._np[s.name][sb.row, sb.trimmed[s.name] : dead] >= 0).sum())
            out[s.name] = new
        return out

    def _needs(self, sb: SeqBlocks | None, ctx: int, total: int) -> dict[str, int] | None:
        """Blocks each group must add; None if some pool (or the row pool) is short."""
        out = self._new_blocks(sb, ctx, total)
        if not self.fits(out) or (sb is None and self.slots.num_free < 1):
            return None
        return out

    def fits(self, need: dict[str, int]) -> bool:
        """Whether every group has `need[group]` free blocks."""
        return all(n <= self.pools[g].num_free for g, n in need.items())

    def blocks_needed(self, seq: KVUser, num_new_tokens: int) -> dict[str, int]:
        """Blocks per group the next num_new_tokens of seq take (net of window blocks it frees);
        {} on the decode fast path. The scheduler sums these to see whether a step must preempt."""
        ctx = seq.num_computed_tokens
        sb = self._seqs.get(seq.seq_id)
        if sb is not None and not self._has_windows and ctx + num_new_tokens <= sb.room:
            return {}
        return self._new_blocks(sb, ctx, ctx + num_new_tokens)

    def can_allocate(self, seq: KVUser, num_new_tokens: int, prefix: PrefixHit | None = None) -> bool:
        """Whether every group (and the row pool) can take this sequence's next tokens (after attaching
        `prefix`, whose blocks leave the evictable set and so stop counting as free)."""
        ctx = seq.num_computed_tokens
        if prefix is None or not prefix.num_tokens:
            return self._needs(self._seqs.get(seq.seq_id), ctx, ctx + num_new_tokens) is not None
        if self.slots.num_free < 1:
            return False
        total = ctx + num_new_tokens
        for s in self.specs:
            hit = prefix.blocks[s.name]  # TIER entries (read back from a lower tier) need a fresh block each
            need = max(0, self.table_len(s, total) - len(hit)) + sum(1 for b in hit if b == TIER)
            if need > self.pools[s.name].num_free - self.pools[s.name].num_reclaimed_by(hit):
                return False
        return True

    def use_backend(self, backend) -> None:
        """The backend whose caches these tables index (the model runner's): the lower tiers copy with it."""
        self.backend = backend

    def try_extend(self, seq: KVUser, num_new_tokens: int) -> bool:
        """The decode fast path: cover the next tokens when no group needs a block or frees one.

        True when done (what allocate would do); False when allocate must run (new blocks, a
        window to trim, or a sequence holding nothing yet). Costs O(1), not O(groups).
        """
        if self._has_windows:
            return False
        sb = self._seqs.get(seq.seq_id)
        total = seq.num_computed_tokens + num_new_tokens
        if sb is None or total > sb.room or total > self.max_model_len:
            return False
        if total > sb.num_tokens:
            sb.num_tokens = total
        return True

    def allocate(self, seq: KVUser, num_new_tokens: int, prefix: PrefixHit | None = None) -> None:
        """Grow the tables to cover num_computed_tokens + num_new_tokens; frees dead window blocks first.
        `prefix` (from match_prefix, for a sequence holding nothing): its cached blocks are attached first;
        the caller has set num_computed_tokens to prefix.num_tokens."""
        ctx = seq.num_computed_tokens
        total = ctx + num_new_tokens
        sb = self._seqs.get(seq.seq_id)
        attach = prefix is not None and prefix.num_tokens > 0
        if attach:
            if sb is not None or ctx != prefix.num_tokens:
                raise DeepInferError(f"{seq.seq_id!r}: a prefix attaches only to a new sequence whose "
                                     "num_computed_tokens is the prefix's length")
            if not self.can_allocate(seq, num_new_tokens, prefix):
                raise DeepInferError(f"KV cache cannot take {num_new_tokens} tokens of {seq.seq_id!r}: "
                                     "check can_allocate first")
        elif self._needs(sb, ctx, total) is None:
            raise DeepInferError(f"KV cache cannot take {num_new_tokens} tokens of {seq.seq_id!r}: check can_allocate first")
        if total > self.max_model_len:
            raise DeepInferError(f"{seq.seq_id!r} would hold {total} tokens, beyond max_model_len={self.max_model_len}")
        if sb is None:
            sb = SeqBlocks(row=self.slots.allocate(1)[0], num_blocks={s.name: 0 for s in self.specs},
                           trimmed={s.name: 0 for s in self.specs})
            self._seqs[seq.seq_id] = sb
            if attach:
                self._attach(sb, prefix)
        self._trim(sb, ctx)
        for s in self.specs:
            held = sb.num_blocks[s.name]
            new = self.table_len(s, total) - held
            if new > 0:
                self._np[s.name][sb.row, held : held + new] = self.pools[s.name].allocate(new)
                sb.num_blocks[s.name] = held + new
                self._changes[s.name].append((sb.row, held, held + new))
        if attach and prefix.tier_keys:
            self._load_tier_blocks(sb, prefix)
        if attach and prefix.snapshot != -1 and self.snapshots is not None:
            self._restore_snapshot(sb, prefix)
        if attach and self._tier is not None:
            self._tier.loaded()  # the hit's copies up (and its snapshot restore): one copy_async call
        sb.num_tokens = max(sb.num_tokens, total)
        # table_len(s, t) <= num_blocks while t // m <= num_blocks * block_size
        sb.room = min((sb.num_blocks[s.name] * self.block_size + 1) * s.tokens_per_entry - 1 for s in self.specs)

    def trim(self, seq: KVUser) -> None:
        """Return sliding-window blocks no longer read once num_computed_tokens tokens are cached."""
        if not self._has_windows:
            return
        sb = self._seqs.get(seq.seq_id)
        if sb is not None:
            self._trim(sb, seq.num_computed_tokens)

    def _trim(self, sb: SeqBlocks, num_tokens: int) -> None:
        for s in self.specs:
            if s.sliding_window is None:
                continue
            first, dead = sb.trimmed[s.name], min(self.dead_blocks(s, num_tokens), sb.num_blocks[s.name])
            if dead > first:
                entries = self._np[s.name][sb.row, first:dead]
                self.pools[s.name].free(entries[entries >= 0].tolist())
                entries[:] = -1
                sb.trimmed[s.name] = dead
                self._changes[s.name].append((sb.row, first, dead))

    def rollback(self, seq: KVUser, num_tokens: int) -> None:
        """Speculative decoding: the tables cover only the first num_tokens tokens again; blocks wholly past
        them (they held rejected drafts' KV) go back to the pool. Blocks keyed in the prefix cache are never
        taken back (they hold only verified tokens: the caller keys after verification). A sliding window can
        go back as far as it still holds the window of num_tokens: window_rollback_tokens behind the furthest
        position it was trimmed for. Per-sequence state (V4's compressor rings) rolls back by at most
        state_rollback_tokens (tokens covered minus num_tokens): the rings were built that much longer than the
        compressors need, so the rejected positions overwrote no slot still read; farther is refused."""
        sb = self._seqs.get(seq.seq_id)
        if sb is None:
            return
        if self.uses_state and sb.num_tokens - num_tokens > self.state_rollback_tokens:
            raise DeepInferError(
                f"{seq.seq_id!r}: rollback of {sb.num_tokens - num_tokens} tokens past what the per-sequence state "
                f"(compressor rings) allows (state_rollback_tokens={self.state_rollback_tokens})")
        if num_tokens < sb.num_keyed * self.block_size:
            raise DeepInferError(f"{seq.seq_id!r}: rollback to {num_tokens} tokens would drop blocks keyed in the "
                                 f"prefix cache ({sb.num_keyed} blocks)")
        for s in self.specs:
            if s.sliding_window is not None and s.first_live_entry(num_tokens) // self.block_size < sb.trimmed[s.name]:
                raise DeepInferError(
                    f"{seq.seq_id!r}: rollback to {num_tokens} tokens needs window blocks of group {s.name!r} already "
                    f"returned (window_rollback_tokens={self.window_rollback_tokens} kept behind the window)")
        for s in self.specs:
            held, keep = sb.num_blocks[s.name], self.table_len(s, num_tokens)
            if held > keep:
                entries = self._np[s.name][sb.row, keep:held]
                self.pools[s.name].free(entries.tolist())
                entries[:] = -1
                sb.num_blocks[s.name] = keep
                sb.trimmed[s.name] = min(sb.trimmed[s.name], keep)
                self._changes[s.name].append((sb.row, keep, held))
        sb.num_tokens = min(sb.num_tokens, num_tokens)
        sb.room = min((sb.num_blocks[s.name] * self.block_size + 1) * s.tokens_per_entry - 1 for s in self.specs)

    def free(self, seq: KVUser | str) -> None:
        """Return every block and the row of a sequence (finish, abort or preemption)."""
        seq_id = seq if isinstance(seq, str) else seq.seq_id
        sb = self._seqs.pop(seq_id, None)
        if sb is None:
            return
        for s in self.specs:
            n = sb.num_blocks[s.name]
            entries = self._np[s.name][sb.row, :n]
            self.pools[s.name].free(entries.tolist())
            entries[:] = -1
            if n:
                self._changes[s.name].append((sb.row, 0, n))
        self.slots.free([sb.row])

    def take_table_changes(self) -> dict[str, list[tuple[int, int, int]]]:
        """The (row, start, end) ranges of block_tables written since the last call, per group; a copy of
        the tables elsewhere (the device mirror the batch builder keeps) applies them to stay equal."""
        out = {g: c for g, c in self._changes.items() if c}
        for g in out:
            self._changes[g] = []
        return out

    def block_table(self, seq_id: str, group: str) -> list[int]:
        """The sequence's block ids in `group`, in order (-1 where a window block was returned)."""
        sb = self._seqs[seq_id]
        return self._np[group][sb.row, : sb.num_blocks[group]].tolist()

    def state_slot(self, seq_id: str) -> int:
        """The sequence's row: in the state pools and in `block_tables`; -1 when it holds nothing."""
        sb = self._seqs.get(seq_id)
        return -1 if sb is None else sb.row

    def has(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    # ------------------------------------------------------------ accounting

    @property
    def num_blocks_total(self) -> int:
        return sum(p.num_blocks for p in self.pools.values())

    @property
    def num_blocks_used(self) -> int:
        return sum(p.num_used for p in self.pools.values())

    def usage(self) -> float:
        """Fraction used of the fullest group: the one that limits admission."""
        fracs = [p.num_used / p.num_blocks for p in self.pools.values() if p.num_blocks]
        return max(fracs, default=0.0)

    def usage_by_group(self) -> dict[str, tuple[int, int]]:
        return {name: (p.num_used, p.num_blocks) for name, p in self.pools.items()}

    @property
    def num_cached_blocks(self) -> int:
        return sum(p.num_cached for p in self.pools.values() if isinstance(p, CachingBlockPool))
