"""Prefix caching's bookkeeping under a randomized workload of 1,000 requests with shared prefixes, against a
simple reference model: KVCacheManager + CachingBlockPool driven directly (no model), with a fake KV store
that records which token each slot holds.

After every operation: each block is exactly one of free / cached / held, its reference count equals the
number of sequences whose table holds it, and no held block is evictable. On every hit the attached blocks
hold exactly the sequence's own tokens (a hit is never wrong KV); with no eviction yet, the hit is exactly
the reference's longest computed prefix (capped so one token is left to compute); at the end, after every
sequence is gone, nothing leaks."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import torch

from deepinfer.backend import KVCacheSpec
from deepinfer.kv.manager import KVCacheManager

BS = 4


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


class Harness:
    def __init__(self, num_blocks: int, seed: int):
        spec = KVCacheSpec(name="mla", layer_ids=(0,), entry_shape=(8,), dtype=torch.float32)
        self.kv = KVCacheManager([spec], {"mla": num_blocks}, BS, max_num_seqs=8, max_model_len=128,
                                 prefix_caching=True, cache_salt=b"salt")
        self.pool = self.kv.pools["mla"]
        self.store: dict[tuple[int, int], int] = {}  # (block, offset) -> the token whose KV it holds
        self.computed: set[tuple[int, ...]] = set()  # reference: every full-block prefix ever computed
        self.rng = random.Random(seed)
        self.active: list[FakeSeq] = []
        self.waiting: list[FakeSeq] = []
        self.hits = 0

    def table(self, seq: FakeSeq) -> list[int]:
        return self.kv.block_table(seq.seq_id, "mla")

    def reference_hit(self, seq: FakeSeq) -> int:
        toks, n = seq.tokens(), 0
        while (n + 1) * BS <= seq.num_tokens - 1 and tuple(toks[: (n + 1) * BS]) in self.computed:
            n += 1
        return n * BS

    def admit(self, seq: FakeSeq) -> bool:
        prefix = self.kv.match_prefix(seq)
        seq.num_computed_tokens = prefix.num_tokens
        n = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randint(1, 12))
        if not self.kv.can_allocate(seq, n, prefix):
            seq.num_computed_tokens = 0
            return False
        before = self.pool.num_evictions
        self.kv.allocate(seq, n, prefix)
        hit_blocks = self.table(seq)[: prefix.num_tokens // BS]
        toks = seq.tokens()
        for i, b in enumerate(hit_blocks):  # a hit is never wrong KV
            for j in range(BS):
                assert self.store[(b, j)] == toks[i * BS + j], (seq.seq_id, i, j)
        if self.pool.num_evictions == before == 0:
            assert prefix.num_tokens == self.reference_hit(seq)
        else:
            assert prefix.num_tokens <= self.reference_hit(seq)
        self.hits += prefix.num_tokens
        self.compute(seq, n)
        self.active.append(seq)
        return True

    def compute(self, seq: FakeSeq, n: int) -> None:
        """The forward: the next n tokens' KV lands in their slots; then the scheduler's advance."""
        table, toks = self.table(seq), seq.tokens()
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
            self.store[(table[p // BS], p % BS)] = toks[p]
        seq.num_computed_tokens += n
        full = seq.num_computed_tokens // BS
        for i in range(full):
            self.computed.add(tuple(toks[: (i + 1) * BS]))
        self.kv.register_computed(seq)

    def step(self, seq: FakeSeq) -> None:
        if seq.num_computed_tokens < seq.num_tokens:  # still in its prompt (a recompute too): a chunk
            n = min(seq.num_tokens - seq.num_computed_tokens, self.rng.randint(1, 12))
        else:  # decode: the sampled token joins, then its KV is computed next step
            seq.output_token_ids.append(self.rng.randrange(2, 6))
            n = 1
        if not self.kv.can_allocate(seq, n):
            self.preempt(seq)
            return
        self.kv.allocate(seq, n)
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
        self.pool.check()
        counts: dict[int, int] = {}
        for s in self.active:
            for b in self.table(s):
                counts[b] = counts.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            assert self.pool.ref[b] == counts.get(b, 0), b
            assert not (counts.get(b) and b in self.pool.evictable)


@pytest.mark.parametrize("num_blocks,seed,check_every", [(8000, 0, 97), (40, 1, 1), (24, 2, 1)])
def test_thousand_requests_with_shared_prefixes(num_blocks, seed, check_every):
    """8000 blocks: never an eviction, so every hit must equal the reference; 40 and 24: eviction under
    pressure, every hit still right."""
    h = Harness(num_blocks, seed)
    rng = h.rng
    prefixes = [[rng.randrange(2, 6) for _ in range(rng.randint(0, 22))] for _ in range(6)]
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
    assert h.kv.num_blocks_used == 0 and h.pool.num_free == num_blocks
    assert all(r == 0 for r in h.pool.ref)
    assert h.hits > 0
    if num_blocks == 8000:
        assert h.pool.num_evictions == 0
    else:
        assert h.pool.num_evictions > 0
