"""V4's hybrid prefix cache (sliding window + compressed groups with compressor state) under a randomized
workload of 1,000 requests with shared prefixes, against a reference: KVCacheManager driven directly (no
model), with a fake KV store in which every slot records the prefix its content depends on.

The fake store: a window slot of token p holds tokens[: p + 1] (a key depends on everything before it); a
compressed entry e holds tokens[: (e + 1) * m]; a snapshot slot holds the prefix whose boundary it
captured (the ring, written by the "op" from the step's plan) and the partly filled block's entries
(copied at registration). A restore copies them into the sequence's state row and fresh blocks, so after
every hit the sequence's whole visible state (window, entries, ring, partial entries) must be exactly its
own prefix's: a hit is never wrong KV or wrong state. After every operation every block of every group is
in exactly one state, reference counts equal the tables, no held block is evictable; at the end nothing
leaks. With no eviction, each hit equals the reference's deepest prefix that was ever computed."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer.backend import KVCacheSpec
from deepinfer.kv.manager import KVCacheManager
from deepinfer.kv.state_snapshots import partial_entries

BS, W, RATES = 4, 6, {"csa": 2, "hca": 4}


@dataclass(eq=False)
class FakeSeq:
    seq_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_keys: list[bytes] = field(default_factory=list)
    target_outputs: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, a: int, b: int) -> list[int]:
        return self.tokens()[a:b]


@dataclass
class Item:  # what snapshot_plan reads of a scheduled sequence
    seq: FakeSeq
    context_len: int
    num_tokens: int


class FakeSnapshots:
    """StateSnapshots' interface over the fake store (slot -> captured prefix / entries)."""

    def __init__(self, harness: "Harness", groups):
        self.h, self.groups = harness, groups
        self.rings: dict[int, tuple] = {}
        self.entries: dict[tuple[int, str], list] = {}
        self.plan = None

    def partial_entries(self, num_tokens):
        return partial_entries(self.groups, BS, num_tokens)

    def capture_entries(self, slot, blocks):
        for g, (b, n) in blocks.items():
            self.entries[(slot, g)] = [self.h.store[(g, b, j)] for j in range(n)]

    def restore(self, slot, row, blocks):
        self.h.state[row] = self.rings[slot]
        for g, (b, n) in blocks.items():
            for j, v in enumerate(self.entries[(slot, g)][:n]):
                self.h.store[(g, b, j)] = v


class Harness:
    def __init__(self, num_blocks: int, seed: int):
        specs = [KVCacheSpec(name="swa", layer_ids=(0, 1, 2), entry_shape=(4,), dtype=torch.float32, sliding_window=W)]
        specs += [KVCacheSpec(name=g, layer_ids=(1,), entry_shape=(4,), dtype=torch.float32, tokens_per_entry=m,
                              state_shape=(2 * m, 8)) for g, m in RATES.items()]
        self.kv = KVCacheManager(specs, {"swa": num_blocks, "csa": num_blocks, "hca": num_blocks}, BS, max_num_seqs=8,
                                 max_model_len=128, prefix_caching=True, cache_salt=b"salt")
        self.snaps = FakeSnapshots(self, specs[1:])
        self.kv.attach_state_snapshots(self.snaps)
        self.store: dict[tuple[str, int, int], tuple] = {}  # (group, block, offset) -> the prefix it depends on
        self.state: dict[int, tuple] = {}  # state row -> the prefix its rings hold
        self.computed: set[tuple[int, ...]] = set()
        self.rng = random.Random(seed)
        self.active: list[FakeSeq] = []
        self.waiting: list[FakeSeq] = []
        self.hits = 0

    def table(self, seq: FakeSeq, g: str) -> list[int]:
        return self.kv.block_table(seq.seq_id, g)

    def reference_hit(self, seq: FakeSeq) -> int:
        toks, n = seq.tokens(), 0
        while (n + 1) * BS <= seq.num_tokens - 1 and tuple(toks[: (n + 1) * BS]) in self.computed:
            n += 1
        return n * BS

    def check_state(self, seq: FakeSeq) -> None:
        """What the next step reads: the window keys, every entry, the ring: all of this sequence's prefix."""
        toks, ctx = tuple(seq.tokens()), seq.num_computed_tokens
        swa = self.table(seq, "swa")
        for p in range(max(0, ctx - W + 1), ctx):
            assert self.store[("swa", swa[p // BS], p % BS)] == toks[: p + 1], (seq.seq_id, p)
        for g, m in RATES.items():
            t = self.table(seq, g)
            for e in range(ctx // m):
                assert self.store[(g, t[e // BS], e % BS)] == toks[: (e + 1) * m], (seq.seq_id, g, e)
        if ctx:
            assert self.state[self.kv.state_slot(seq.seq_id)] == toks[:ctx]

    def admit(self, seq: FakeSeq) -> bool:
        prefix = self.kv.match_prefix(seq)
        seq.num_computed_tokens = prefix.num_tokens
        n = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randint(1, 12))
        if not self.kv.can_allocate(seq, n, prefix):
            seq.num_computed_tokens = 0
            return False
        before = sum(p.num_evictions for p in self.kv.pools.values())
        self.kv.allocate(seq, n, prefix)
        self.check_state(seq)  # a hit is never wrong KV or state
        if before == 0 and all(p.num_evictions == 0 for p in self.kv.pools.values()):
            assert prefix.num_tokens == self.reference_hit(seq)
        else:
            assert prefix.num_tokens <= self.reference_hit(seq)
        self.hits += prefix.num_tokens
        self.compute(seq, n)
        self.active.append(seq)
        return True

    def compute(self, seq: FakeSeq, n: int) -> None:
        """The forward (window keys, entries, rings at the plan's boundaries), then the scheduler's advance."""
        toks, ctx = tuple(seq.tokens()), seq.num_computed_tokens
        plan = self.kv.snapshot_plan([Item(seq, ctx, n)])
        for boundary, slot in (plan or [[]])[0]:
            self.snaps.rings[slot] = toks[:boundary]
        swa = self.table(seq, "swa")
        for p in range(ctx, ctx + n):
            self.store[("swa", swa[p // BS], p % BS)] = toks[: p + 1]
        for g, m in RATES.items():
            t = self.table(seq, g)
            for e in range(ctx // m, (ctx + n) // m):
                self.store[(g, t[e // BS], e % BS)] = toks[: (e + 1) * m]
        self.state[self.kv.state_slot(seq.seq_id)] = toks[: ctx + n]
        seq.num_computed_tokens += n
        for i in range(seq.num_computed_tokens // BS):
            self.computed.add(toks[: (i + 1) * BS])
        self.kv.register_computed(seq)
        self.kv.trim(seq)

    def step(self, seq: FakeSeq) -> None:
        if seq.num_computed_tokens < seq.num_tokens:
            n = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randint(1, 12))
        else:
            seq.output_token_ids.append(self.rng.randrange(2, 6))
            n = 1
        if not self.kv.can_allocate(seq, n):
            self.preempt(seq)
            return
        self.kv.allocate(seq, n)
        self.check_state(seq)
        self.compute(seq, n)

    def preempt(self, seq: FakeSeq) -> None:
        self.active.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        self.waiting.insert(0, seq)

    def finish(self, seq: FakeSeq) -> None:
        self.active.remove(seq)
        self.kv.free(seq)

    def check(self) -> None:
        for g, pool in self.kv.pools.items():
            pool.check()
            counts: dict[int, int] = {}
            for s in self.active:
                for b in self.table(s, g):
                    if b >= 0:
                        counts[b] = counts.get(b, 0) + 1
            for b in range(pool.num_blocks):
                assert pool.ref[b] == counts.get(b, 0), (g, b)
                assert not (counts.get(b) and b in pool.evictable)


@pytest.mark.parametrize("num_blocks,seed,check_every", [(8000, 0, 97), (40, 1, 1), (26, 2, 1)])
def test_thousand_v4_requests_with_shared_prefixes(num_blocks, seed, check_every):
    h = Harness(num_blocks, seed)
    rng = h.rng
    prefixes = [[rng.randrange(2, 6) for _ in range(rng.randint(0, 30))] for _ in range(6)]
    pending = [FakeSeq(f"r{i}", rng.choice(prefixes) + [rng.randrange(2, 6) for _ in range(rng.randint(1, 9))],
                       target_outputs=rng.randint(0, 6)) for i in range(1000)]
    ops = 0
    while pending or h.waiting or h.active:
        ops += 1
        if h.waiting and len(h.active) < 8:
            if not h.admit(h.waiting[0]):
                if not h.active:
                    raise AssertionError("a sequence alone does not fit")
            else:
                h.waiting.pop(0)
        elif pending and len(h.active) < 8 and rng.random() < 0.6:
            seq = pending.pop()
            if not h.admit(seq):
                h.waiting.append(seq)
        for seq in list(h.active):
            r = rng.random()
            if r < 0.03:
                h.finish(seq)  # an abort, whatever its state
            elif seq.num_computed_tokens == seq.num_tokens and len(seq.output_token_ids) >= seq.target_outputs:
                h.finish(seq)
            elif r < 0.06 and len(h.active) > 1:
                h.preempt(seq)
            else:
                h.step(seq)
        if ops % check_every == 0:
            h.check()
    h.check()
    assert h.kv.num_blocks_used == 0
    assert all(p.num_free == num_blocks and not any(p.ref) for p in h.kv.pools.values())
    assert h.hits > 0
    evictions = sum(p.num_evictions for p in h.kv.pools.values())
    assert (evictions == 0) if num_blocks == 8000 else (evictions > 0)
