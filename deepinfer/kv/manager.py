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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from deepinfer.backend import KVCacheSpec
from deepinfer.errors import DeepInferError
from deepinfer.kv.block_pool import BlockPool, SlotPool
from deepinfer.kv.hybrid_prefix import is_hybrid, match_hybrid, register_hybrid, window_group
from deepinfer.kv.planner import window_blocks_per_seq
from deepinfer.kv.prefix_cache import CachingBlockPool, block_key, prefix_caching_refusals
from deepinfer.kv.tier_copies import TierCopies
from deepinfer.kv.tier_link import TierLink


class KVUser(Protocol):
    """What the manager needs to know about a sequence."""

    seq_id: str
    num_computed_tokens: int


@dataclass
class PrefixHit:
    """The cached prefix a sequence can attach: num_tokens tokens, in these device blocks per group, then
    (lower tiers) blocks read back from host memory or files: their keys and payloads, written into new blocks at allocate."""

    num_tokens: int
    blocks: dict[str, list[int]]
    tier_keys: list[bytes] = field(default_factory=list)
    tier_parts: list[list[torch.Tensor]] = field(default_factory=list)
    snapshot: int = -1  # hybrid caches: the state snapshot's slot (the window block ending at num_tokens)
    ready: bool = True  # False: disk reads for it are still running (match_prefix(wait=False)); admit it later


@dataclass
class SeqBlocks:
    """What the manager holds for one sequence; its block ids live in the manager's block_tables."""

    row: int  # its row in block_tables and in the per-sequence state pools
    num_blocks: dict[str, int]  # table entries per group (freed window entries count: they are -1)
    trimmed: dict[str, int]  # leading table entries already returned to the pool (sliding groups)
    num_tokens: int = 0  # tokens the tables cover
    room: int = 0  # most tokens the tables hold before any group needs another block
    num_keyed: int = 0  # leading full blocks already keyed in the prefix cache


class KVCacheManager:
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
    ):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise DeepInferError(f"KV group names must be unique, got {names}")
        self.specs = list(specs)
        self.block_size = block_size
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
        """Leading table entries no longer read when the next token is at position num_tokens."""
        if spec.sliding_window is None:
            return 0
        return spec.first_live_entry(num_tokens) // self.block_size

    def fits_alone(self, num_tokens: int, chunk_tokens: int) -> list[str]:
        """Reasons a single sequence of num_tokens (computed in chunks of chunk_tokens) cannot fit."""
        reasons = []
        for s in self.specs:
            if s.sliding_window is None:
                need = self.table_len(s, num_tokens)
            else:
                need = min(self.table_len(s, num_tokens), window_blocks_per_seq(s, self.block_size, chunk_tokens))
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
            hit = prefix.blocks[s.name]
            need = max(0, self.table_len(s, total) - len(hit))
            if need > self.pools[s.name].num_free - self.pools[s.name].num_reclaimed_by(hit):
                return False
        return True

    # ------------------------------------------------------------ prefix cache

    def block_keys(self, seq, num_blocks: int) -> list[bytes]:
        """The chained keys of the first num_blocks full blocks of seq's tokens, cached on the sequence
        (its tokens only grow, so a key once made stays right)."""
        keys = seq.block_keys
        if len(keys) < num_blocks:
            bs, start = self.block_size, len(keys)
            buf = np.asarray(seq.token_ids_slice(start * bs, num_blocks * bs), dtype=np.int64)
            for i in range(num_blocks - start):
                keys.append(block_key(keys[-1] if keys else b"", buf[i * bs: (i + 1) * bs], self.cache_salt))
        return keys[:num_blocks]

    def match_prefix(self, seq, wait: bool = True) -> PrefixHit | None:
        """The longest cached prefix of a sequence that holds no blocks, leaving at least one token to
        compute (so the step that follows has logits). None without prefix caching. Keys are made only
        as far as the cache hits (one past it), so a long new prompt costs one key here. wait=False: disk reads
        still running leave the hit not `ready` instead of waiting for them (tier_link.py)."""
        if not self.prefix_caching or seq.seq_id in self._seqs:
            return None
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # pending tokens have no ids yet
        n = max((min(seq.num_tokens, known) - 1) // self.block_size, 0)
        if self.hybrid:
            return self._match_hybrid(seq, n)
        hits: dict[str, list[int]] = {s.name: [] for s in self.specs}
        depth = 0
        while depth < n:
            key = seq.block_keys[depth] if depth < len(seq.block_keys) else self.block_keys(seq, depth + 1)[depth]
            found = [self.pools[s.name].block_of.get(key) for s in self.specs]
            if any(b is None for b in found):
                break
            for s, b in zip(self.specs, found):
                hits[s.name].append(b)
            depth += 1
        hit = PrefixHit(depth * self.block_size, hits)
        if self._tier is not None:
            depth, hit.ready = self._tier.extend(hit.num_tokens // self.block_size, n,
                                                 lambda d: self.block_keys(seq, d + 1)[d], hit.tier_keys,
                                                 hit.tier_parts, wait)
            hit.num_tokens = depth * self.block_size
        return hit

    def use_backend(self, backend) -> None:
        """The backend whose caches these tables index (the model runner's): the lower tiers copy with it."""
        self.backend = backend

    def _match_hybrid(self, seq, n: int) -> PrefixHit:
        if self.uses_state and self.snapshots is None:
            raise DeepInferError("prefix caching on a model with per-sequence state needs its state snapshots: "
                                 "call attach_state_snapshots first")
        depth, blocks = match_hybrid(self.specs, self.pools, self.block_size, n,
                                     lambda d: self.block_keys(seq, d + 1)[d], self.dead_blocks)
        if not depth:
            return PrefixHit(0, {s.name: [] for s in self.specs})
        return PrefixHit(depth * self.block_size, blocks, snapshot=blocks[self.window_group][depth - 1])

    def attach_state_snapshots(self, snapshots) -> None:
        """The store of compressor state at block boundaries (state_snapshots.StateSnapshots), one slot per
        block of the window group: a hit restores from it, registration fills its partial entries."""
        if not (self.hybrid and self.uses_state):
            raise DeepInferError("state snapshots serve prefix caching on a model with per-sequence state")
        self.snapshots = snapshots

    def snapshot_plan(self, scheduled) -> list[list[tuple[int, int]]] | None:
        """Per scheduled item (seq, context_len, num_tokens): [(B, slot)] for each block boundary
        context_len < B <= context_len + num_tokens, slot = the window block ending at B. None without
        snapshots or when no item crosses a boundary."""
        if self.snapshots is None:
            return None
        bs, table, out, any_ = self.block_size, self._np[self.window_group], [], False
        for it in scheduled:
            row = self._seqs[it.seq.seq_id].row
            ks = range(it.context_len // bs + 1, (it.context_len + it.num_tokens) // bs + 1)
            out.append([(k * bs, int(table[row, k - 1])) for k in ks])
            any_ = any_ or bool(out[-1])
        return out if any_ else None

    def attach_tiers(self, host, disk, block_io) -> None:
        """Evicted keyed blocks go to the host tier (host_tier.HostTier), from there to disk
        (disk_tier.DiskTier); hits continue into them (tier_link.py). Either may be None. The copies run on
        the backend's copy stream (tier_copies.py), so use_backend must have been called."""
        if not self.prefix_caching or len(self.specs) != 1:
            raise DeepInferError("the host / disk tiers need prefix caching on a model with one KV group")
        if self.backend is None:
            raise DeepInferError("the host / disk tiers copy through the backend: call use_backend first "
                                 "(the model runner does, for a model that holds its backend)")
        self.host_tier, self.disk_tier = host, disk
        self._tier = TierLink(host, disk, block_io, self.pools[self.specs[0].name], TierCopies(self.backend))

    def fence_tier_copies(self) -> None:
        """Before a step is launched: its compute waits (on the device) for the tiers' copies queued so far."""
        if self._tier is not None:
            self._tier.fence()

    def register_computed(self, seq) -> None:
        """Key the sequence's full blocks whose tokens are all computed and known on the host."""
        if not self.prefix_caching:
            return
        sb = self._seqs.get(seq.seq_id)
        if sb is None:
            return
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
        full = min(seq.num_computed_tokens, known) // self.block_size
        if full <= sb.num_keyed:
            return
        keys = self.block_keys(seq, full)
        if self.hybrid:
            register_hybrid(self.specs, self.pools, self._np, sb.row, sb.num_keyed, full, keys)
            if self.snapshots is not None:
                self._capture_partials(sb, keys, full)
            sb.num_keyed = full
            return
        for s in self.specs:
            row = self._np[s.name][sb.row]
            pool = self.pools[s.name]
            for i in range(sb.num_keyed, full):
                pool.register(int(row[i]), keys[i])
        sb.num_keyed = full

    def _capture_partials(self, sb: SeqBlocks, keys: list[bytes], full: int) -> None:
        """For each newly keyed window block: its slot gets the partly filled compressed blocks at its end."""
        table, pool = self._np[self.window_group][sb.row], self.pools[self.window_group]
        for i in range(sb.num_keyed, full):
            slot = int(table[i])
            if slot < 0 or pool.block_of.get(keys[i]) != slot:  # another block holds this key (and its snapshot)
                continue
            parts = self.snapshots.partial_entries((i + 1) * self.block_size)
            self.snapshots.capture_entries(slot, {g: (int(self._np[g][sb.row, j]), n) for g, (j, n) in parts.items()})

    def _restore_snapshot(self, sb: SeqBlocks, prefix: PrefixHit) -> None:
        parts = self.snapshots.partial_entries(prefix.num_tokens)
        self.snapshots.restore(prefix.snapshot, sb.row,
                               {g: (int(self._np[g][sb.row, j]), n) for g, (j, n) in parts.items()})

    def _load_tier_blocks(self, sb: SeqBlocks, prefix: PrefixHit) -> None:
        group = self.specs[0].name
        first = len(prefix.blocks[group])
        self._tier.load(self._np[group][sb.row, first: first + len(prefix.tier_keys)], prefix.tier_keys,
                        prefix.tier_parts)
        sb.num_keyed = first + len(prefix.tier_keys)
        self.prefix_tier_hit_tokens += len(prefix.tier_keys) * self.block_size

    def _attach(self, sb: SeqBlocks, prefix: PrefixHit) -> None:
        for s in self.specs:
            hit = prefix.blocks[s.name]
            if hit:
                self.pools[s.name].take(hit)
                self._np[s.name][sb.row, : len(hit)] = hit
                sb.num_blocks[s.name] = len(hit)
                sb.trimmed[s.name] = sum(1 for b in hit if b < 0)  # window entries below the window: -1
                self._changes[s.name].append((sb.row, 0, len(hit)))
        sb.num_keyed = prefix.num_tokens // self.block_size

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
        if attach and prefix.snapshot >= 0 and self.snapshots is not None:
            self._restore_snapshot(sb, prefix)
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
        taken back (they hold only verified tokens: the caller keys after verification). Full-attention
        groups only: sliding windows and per-sequence state are V4's, where speculation is refused."""
        sb = self._seqs.get(seq.seq_id)
        if sb is None:
            return
        if self._has_windows or self.uses_state:
            raise DeepInferError("KVCacheManager.rollback: sliding-window / stateful KV groups cannot roll back")
        if num_tokens < sb.num_keyed * self.block_size:
            raise DeepInferError(f"{seq.seq_id!r}: rollback to {num_tokens} tokens would drop blocks keyed in the "
                                 f"prefix cache ({sb.num_keyed} blocks)")
        for s in self.specs:
            held, keep = sb.num_blocks[s.name], self.table_len(s, num_tokens)
            if held > keep:
                entries = self._np[s.name][sb.row, keep:held]
                self.pools[s.name].free(entries.tolist())
                entries[:] = -1
                sb.num_blocks[s.name] = keep
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
        if self._tier is not None and not self._seqs:
            self._tier.idle()  # nothing running: queued disk writes may finish now

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
