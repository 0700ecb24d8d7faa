"""Prefix caching's half of KVCacheManager: what a sequence that holds nothing can attach (the match), how it
attaches it, and how computed blocks are keyed for later hits.

A mixin of manager.KVCacheManager (it reads the manager's pools, tables and per-sequence records). V2 / V3: the
longest run of keyed leading blocks, then the lower tiers (tier_traffic.py). V4's hybrid cache
(hybrid_prefix.py): the window's blocks and the compressed groups' complete blocks, device or lower tier, and
the compressor state restored from state_snapshots.py. docs/kv-cache.md says what each hit recomputes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from deepinfer.errors import DeepInferError
from deepinfer.kv.hybrid_prefix import match_hybrid, register_hybrid
from deepinfer.kv.prefix_cache import chain_keys


@dataclass
class PrefixHit:
    """The cached prefix a sequence can attach: num_tokens tokens, in these device blocks per group, then
    (lower tiers) blocks read back from host memory or files: their keys and payloads, written into new blocks at
    allocate. On a hybrid cache the tier blocks sit inside `blocks` as TIER entries, read back per `loads`."""

    num_tokens: int
    blocks: dict[str, list[int]]
    tier_keys: list[bytes] = field(default_factory=list)
    tier_parts: list = field(default_factory=list)  # host_tier.SlotRef (host memory) or host tensors (disk)
    snapshot: int = -1  # hybrid caches: the state snapshot's slot (the window block ending at num_tokens)
    ready: bool = True  # False: disk reads for it are still running (match_prefix(wait=False)); admit it later
    # hybrid caches with lower tiers: (group, table index, key, payload) of each TIER entry of `blocks`
    loads: list[tuple[str, int, bytes, object]] = field(default_factory=list)  # payload: as in tier_parts


class PrefixAdmission:
    """match_prefix / register_computed and the attach that allocate runs for a hit (KVCacheManager's)."""

    def block_keys(self, seq, num_blocks: int) -> list[bytes]:
        """The chained keys of the first num_blocks full blocks of seq's tokens, cached on the sequence
        (its tokens only grow, so a key once made stays right)."""
        keys = seq.block_keys
        if len(keys) < num_blocks:
            bs, start = self.block_size, len(keys)
            keys += chain_keys(keys[-1] if keys else b"", seq.token_ids_slice(start * bs, num_blocks * bs), bs,
                               self.cache_salt)
        return keys if len(keys) == num_blocks else keys[:num_blocks]

    def block_key_at(self, seq, d: int) -> bytes:
        """Key d of seq (made with those before it when missing): no list copy, unlike block_keys(seq, d + 1)[d],
        which a loop over d would make quadratic."""
        keys = seq.block_keys
        return keys[d] if d < len(keys) else self.block_keys(seq, d + 1)[d]

    def match_prefix(self, seq, wait: bool = True) -> PrefixHit | None:
        """The longest cached prefix of a sequence that holds no blocks, leaving at least one token to
        compute (so the step that follows has logits). None without prefix caching. The keys of all the
        prompt's known full blocks are made at once (one array conversion, chain_keys) and kept on the sequence:
        a miss costs ~0.1 ms per 2k tokens for them, and register_computed reuses them after its prefill.
        wait=False: disk reads still running leave the hit not `ready` instead of waiting for them
        (tier_link.py)."""
        if not self.prefix_caching or seq.seq_id in self._seqs:
            return None
        known = len(seq.prompt_token_ids) + len(seq.output_token_ids)  # pending tokens have no ids yet
        n = max((min(seq.num_tokens, known) - 1) // self.block_size, 0)
        if self.hybrid:
            return self._match_hybrid(seq, n, wait)
        keys = self.block_keys(seq, n) if n else []
        hits: dict[str, list[int]] = {}
        depth = n
        for s in self.specs:  # per group, the longest run of keyed leading blocks; the hit is the shortest run
            got = hits[s.name] = self.pools[s.name].lookup(keys[:depth])
            depth = len(got)
        for s in self.specs:
            del hits[s.name][depth:]
        hit = PrefixHit(depth * self.block_size, hits)
        if self._tier is not None:
            depth, hit.ready = self._tier.extend(hit.num_tokens // self.block_size, n,
                                                 partial(self.block_key_at, seq), hit.tier_keys,
                                                 hit.tier_parts, wait)
            hit.num_tokens = depth * self.block_size
        return hit

    def _match_hybrid(self, seq, n: int, wait: bool = True) -> PrefixHit:
        if self.uses_state and self.snapshots is None:
            raise DeepInferError("prefix caching on a model with per-sequence state needs its state snapshots: "
                                 "call attach_state_snapshots first")
        key_at = partial(self.block_key_at, seq)
        missing: set[tuple[str, bytes]] = set()  # tier blocks whose read failed: match again without them
        while True:
            depth, blocks = match_hybrid(self.specs, lambda g, k: self._find(g, k, missing), self.block_size, n,
                                         key_at, self.dead_blocks)
            if not depth:
                return PrefixHit(0, {s.name: [] for s in self.specs})
            hit = PrefixHit(depth * self.block_size, blocks, snapshot=blocks[self.window_group][depth - 1])
            if self._tier is None:
                return hit
            ok, ready = self._fetch_tier_blocks(hit, key_at, missing, wait)
            if not ready:
                return PrefixHit(0, {s.name: [] for s in self.specs}, ready=False)
            if ok:
                return hit

    def attach_state_snapshots(self, snapshots) -> None:
        """The store of compressor state at block boundaries (state_snapshots.StateSnapshots), one slot per
        block of the window group: a hit restores from it, registration fills its partial entries. With the
        lower tiers attached, a window block carries its slot down and back (tier_traffic.py)."""
        if not (self.hybrid and self.uses_state):
            raise DeepInferError("state snapshots serve prefix caching on a model with per-sequence state")
        self.snapshots = snapshots
        if self._tier is not None:
            self._tier.ios[self.window_group].add_parts(snapshots.slot_tensors())
            self._tier.carve_host()  # the window block's slots grew: size the (still empty) host pool again

    def snapshot_plan(self, scheduled) -> list[list[tuple[int, int]]] | None:
        """Per scheduled item (seq, context_len, num_tokens): [(B, slot)] for each block boundary
        context_len < B <= context_len + num_tokens, slot = the window block ending at B. None without
        snapshots or when no item crosses a boundary."""
        if self.snapshots is None:
            return None
        return self.snapshot_plan_rows([(self._seqs[it.seq.seq_id].row, it.context_len, it.num_tokens)
                                        for it in scheduled])

    def snapshot_plan_rows(self, rows: list[tuple[int, int, int]]) -> list[list[tuple[int, int]]] | None:
        """snapshot_plan over (table row, context_len, num_tokens) per request: a forward that is not the step's
        own (V4's MTP pass over the step's known rows, spec/mtp_drafter.py)."""
        bs, table, out, any_ = self.block_size, self._np[self.window_group], [], False
        for row, ctx, n in rows:
            ks = range(ctx // bs + 1, (ctx + n) // bs + 1)
            out.append([(k * bs, int(table[row, k - 1])) for k in ks])
            any_ = any_ or bool(out[-1])
        return out if any_ else None

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

    def _capture_partials(self, sb, keys: list[bytes], full: int) -> None:
        """For each newly keyed window block: its slot gets the partly filled compressed blocks at its end."""
        table, pool = self._np[self.window_group][sb.row], self.pools[self.window_group]
        for i in range(sb.num_keyed, full):
            slot = int(table[i])
            if slot < 0 or pool.block_of.get(keys[i]) != slot:  # another block holds this key (and its snapshot)
                continue
            parts = self.snapshots.partial_entries((i + 1) * self.block_size)
            self.snapshots.capture_entries(slot, {g: (int(self._np[g][sb.row, j]), n) for g, (j, n) in parts.items()})

    def _restore_snapshot(self, sb, prefix: PrefixHit) -> None:
        """The hit's compressor rings and partial entries, from the slot of the window block ending at the hit
        (read from the table: a block read back from a lower tier got a fresh id, and its slot with it)."""
        parts = self.snapshots.partial_entries(prefix.num_tokens)
        slot = int(self._np[self.window_group][sb.row, prefix.num_tokens // self.block_size - 1])
        blocks = {g: (int(self._np[g][sb.row, j]), n) for g, (j, n) in parts.items()}
        if self._tier is None:
            self.snapshots.restore(slot, sb.row, blocks)
        else:  # with the tiers on the copy stream, behind the copy up that may have filled the slot
            self.snapshots.restore(slot, sb.row, blocks, copies=self._tier.copies)

    def _attach(self, sb, prefix: PrefixHit) -> None:
        for s in self.specs:
            hit = prefix.blocks[s.name]
            if hit:
                self.pools[s.name].take(hit)
                self._np[s.name][sb.row, : len(hit)] = hit
                sb.num_blocks[s.name] = len(hit)
                sb.trimmed[s.name] = sum(1 for b in hit if b == -1)  # window entries below the window: -1
                self._changes[s.name].append((sb.row, 0, len(hit)))
        if prefix.loads:
            self._load_hybrid_tier_blocks(sb, prefix)
        sb.num_keyed = prefix.num_tokens // self.block_size
