"""Block pool and KV manager: full, sliding-window, compressed and state groups; exact accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from deepinfer.backend.kv_spec import KVCacheSpec
from deepinfer.errors import DeepInferError
from deepinfer.kv.block_pool import BlockPool
from deepinfer.kv.manager import KVCacheManager
from deepinfer.kv.planner import bytes_per_token, fixed_bytes_per_seq, plan_kv_cache

BS = 4


@dataclass
class Seq:
    seq_id: str
    num_computed_tokens: int = 0


def full(name="full", layers=(0,)):
    return KVCacheSpec(name, layers, (8,), torch.float32)


def test_block_pool_allocate_free_and_double_free():
    pool = BlockPool(5, "g")
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 2 and pool.num_used == 3
    with pytest.raises(DeepInferError, match="asked for 3 blocks, 2 free"):
        pool.allocate(3)
    pool.free(a)
    assert pool.num_free == 5 and pool.num_used == 0
    with pytest.raises(DeepInferError, match="freed twice"):
        pool.free([a[0]])


def test_full_group_blocks_follow_ceil_tokens_over_block_size():
    kv = KVCacheManager([full()], {"full": 10}, BS, max_num_seqs=4, max_model_len=256)
    s = Seq("a")
    for new, expect in [(1, 1), (3, 1), (1, 2), (7, 3), (4, 4), (1, 5)]:
        kv.allocate(s, new)
        s.num_computed_tokens += new
        assert len(kv.block_table("a", "full")) == expect == math.ceil(s.num_computed_tokens / BS)
    assert kv.num_blocks_used == 5
    kv.free(s)
    assert kv.num_blocks_used == 0


def test_admission_needs_every_group():
    specs = [full(), KVCacheSpec("cmp", (1,), (8,), torch.float32, tokens_per_entry=4)]
    kv = KVCacheManager(specs, {"full": 100, "cmp": 1}, BS, max_num_seqs=4, max_model_len=256)
    s = Seq("a")
    assert kv.can_allocate(s, 16)  # 16 tokens -> 4 entries -> 1 cmp block
    assert not kv.can_allocate(s, 17 * 1 + 3)  # 20 tokens -> 5 entries -> 2 cmp blocks
    kv.allocate(s, 16)
    assert kv.usage_by_group() == {"full": (4, 100), "cmp": (1, 1)}
    assert kv.usage() == 1.0  # the fullest group decides


def test_compressed_group_has_one_entry_per_m_tokens():
    m = 4
    spec = KVCacheSpec("cmp", (0,), (8,), torch.float32, tokens_per_entry=m)
    kv = KVCacheManager([spec], {"cmp": 8}, BS, max_num_seqs=2, max_model_len=256)
    s = Seq("a")
    kv.allocate(s, 3)  # 0 complete entries
    assert kv.block_table("a", "cmp") == []
    s.num_computed_tokens = 3
    kv.allocate(s, 1)  # tokens 0..3 -> entry 0
    assert len(kv.block_table("a", "cmp")) == 1
    s.num_computed_tokens = 4
    kv.allocate(s, 13)  # 17 tokens -> 4 entries -> 1 block; 16 entries would need 4
    assert len(kv.block_table("a", "cmp")) == 1
    s.num_computed_tokens = 17
    kv.allocate(s, 4 * BS * m - 17)  # 64 tokens -> 16 entries -> 4 blocks
    assert len(kv.block_table("a", "cmp")) == 4


def test_sliding_window_returns_old_blocks_and_keeps_minus_one():
    w = 6
    spec = KVCacheSpec("swa", (0,), (8,), torch.float32, sliding_window=w)
    kv = KVCacheManager([spec], {"swa": 5}, BS, max_num_seqs=2, max_model_len=256)
    s = Seq("a")
    used = []
    for _ in range(30):  # decode one token at a time up to 30 tokens
        kv.allocate(s, 1)
        s.num_computed_tokens += 1
        kv.trim(s)
        table = kv.block_table("a", "swa")
        live_from = spec.first_live_entry(s.num_computed_tokens)
        # every entry still read is in a live block; every block wholly older is freed (-1)
        assert all(table[e // BS] >= 0 for e in range(live_from, s.num_computed_tokens))
        assert all(b == -1 for b in table[: live_from // BS])
        assert all(b >= 0 for b in table[live_from // BS :])
        used.append(kv.num_blocks_used)
    assert len(kv.block_table("a", "swa")) == math.ceil(30 / BS)
    assert max(used) <= math.ceil((w - 1) / BS) + 1  # bounded by the window, not the length
    kv.free(s)
    assert kv.num_blocks_used == 0


def test_sliding_window_counts_freeable_blocks_at_admission():
    spec = KVCacheSpec("swa", (0,), (8,), torch.float32, sliding_window=4)
    kv = KVCacheManager([spec], {"swa": 3}, BS, max_num_seqs=1, max_model_len=256)
    s = Seq("a")
    kv.allocate(s, 12)  # 3 blocks, all used
    s.num_computed_tokens = 12
    assert kv.pools["swa"].num_free == 0
    # the next 4 tokens need a 4th block; blocks 0 and 1 are dead (entries < 9), so it fits
    assert kv.can_allocate(s, 4)
    kv.allocate(s, 4)
    assert kv.block_table("a", "swa")[:2] == [-1, -1]
    assert kv.num_blocks_used == 2


def test_state_rows_are_a_pool_of_max_num_seqs():
    spec = KVCacheSpec("cmp", (0, 1), (8,), torch.float32, tokens_per_entry=4, state_shape=(3, 8))
    kv = KVCacheManager([spec], {"cmp": 100}, BS, max_num_seqs=2, max_model_len=256)
    a, b, c = Seq("a"), Seq("b"), Seq("c")
    kv.allocate(a, 5)
    kv.allocate(b, 5)
    assert {kv.state_slot("a"), kv.state_slot("b")} == {0, 1}
    assert not kv.can_allocate(c, 1)  # blocks are free, state rows are not
    kv.allocate(a, 3)  # a keeps its row
    assert kv.slots.num_used == 2
    kv.free(a)
    assert kv.can_allocate(c, 1)
    kv.allocate(c, 1)
    kv.free(b)
    kv.free(c)
    assert kv.slots.num_used == 0 and kv.num_blocks_used == 0


def test_accounting_returns_to_zero_over_many_sequences():
    specs = [
        full(),
        KVCacheSpec("swa", (1,), (8,), torch.float32, sliding_window=5),
        KVCacheSpec("cmp", (2,), (8,), torch.float32, tokens_per_entry=3, state_shape=(2,)),
    ]
    kv = KVCacheManager(specs, {"full": 64, "swa": 64, "cmp": 64}, BS, max_num_seqs=8, max_model_len=256)
    seqs = [Seq(f"s{i}") for i in range(6)]
    g = torch.Generator().manual_seed(0)
    for step in range(40):
        for s in seqs:
            n = int(torch.randint(1, 4, (1,), generator=g))
            if kv.can_allocate(s, n):
                kv.allocate(s, n)
                s.num_computed_tokens += n
                kv.trim(s)
        for s in seqs:  # the host table buffer mirrors every block table, -1 beyond it
            if kv.has(s.seq_id):
                row = kv.state_slot(s.seq_id)
                for spec in specs:
                    t = kv.block_table(s.seq_id, spec.name)
                    buf = kv.block_tables[spec.name][row].tolist()
                    assert buf[: len(t)] == t and all(b == -1 for b in buf[len(t):])
        if step % 7 == 6:  # preempt one
            victim = seqs[step % len(seqs)]
            kv.free(victim)
            victim.num_computed_tokens = 0
    for s in seqs:
        kv.free(s)
    assert kv.num_blocks_used == 0 and kv.slots.num_used == 0
    assert all(p.num_free == p.num_blocks for p in kv.pools.values())
    assert all(bool((t == -1).all()) for t in kv.block_tables.values())


def test_plan_sizes_groups_from_a_byte_budget():
    mla = KVCacheSpec("mla", tuple(range(3)), (576,), torch.bfloat16)
    per_block = BS * mla.bytes_per_entry()
    plan = plan_kv_cache([mla], BS, 8, 64, 32, budget_bytes=10 * per_block + per_block // 2)
    assert plan.num_blocks == {"mla": 10} and plan.capacity_tokens == 10 * BS
    plan = plan_kv_cache([mla], BS, 8, 64, 32, num_kv_blocks=7)
    assert plan.num_blocks == {"mla": 7} and plan.capacity_tokens == 7 * BS


def test_plan_hybrid_groups_share_one_token_capacity():
    specs = [
        KVCacheSpec("full", (0,), (16,), torch.float32),
        KVCacheSpec("cmp", (1,), (16,), torch.float32, tokens_per_entry=4, state_shape=(2, 16)),
        KVCacheSpec("swa", (2,), (16,), torch.float32, sliding_window=8),
    ]
    budget = 1 << 20
    plan = plan_kv_cache(specs, BS, 4, 4096, 64, budget_bytes=budget)
    assert plan.bytes_total <= budget
    cap = plan.capacity_tokens
    assert plan.num_blocks["full"] * BS >= cap and plan.num_blocks["cmp"] * BS * 4 >= cap
    # the window group is capped at max_num_seqs windows (+ one chunk), far below the full group
    assert plan.num_blocks["swa"] < plan.num_blocks["full"] // 10
    # bytes per token: full 64 B + cmp 64/4 B; fixed per seq: window 8 entries * 64 B + state 128 B
    assert bytes_per_token(specs) == 64 + 16
    assert fixed_bytes_per_seq(specs) == 8 * 64 + 2 * 16 * 4


def test_plan_compressed_group_holds_max_num_seqs_partial_blocks():
    """A compressed group (m=8) gets max_num_seqs blocks plus one per block_size of the remaining entries,
    capped at max_num_seqs sequences of max_model_len; full groups keep exactly num_kv_blocks."""
    specs = [KVCacheSpec("full", (0,), (16,), torch.float32),
             KVCacheSpec("cmp", (1,), (16,), torch.float32, tokens_per_entry=8)]
    plan = plan_kv_cache(specs, BS, 6, 4096, 32, num_kv_blocks=40)
    entries = 40 * BS // 8
    assert plan.num_blocks == {"full": 40, "cmp": 6 + (entries - 6) // BS}
    assert plan.capacity_tokens == 40 * BS
    short = plan_kv_cache(specs, BS, 6, 8 * BS, 32, num_kv_blocks=1000)  # one block per sequence is all it needs
    assert short.num_blocks["cmp"] == 6


def test_plan_budget_too_small_names_what_it_cannot_hold():
    mla = KVCacheSpec("mla", (0,), (576,), torch.bfloat16)
    with pytest.raises(DeepInferError, match="cannot hold one block of every KV group"):
        plan_kv_cache([mla], BS, 8, 64, 32, budget_bytes=100)
    cmp = KVCacheSpec("cmp", (1,), (16,), torch.float32, tokens_per_entry=4, state_shape=(2, 16))
    with pytest.raises(DeepInferError, match="cannot hold max_num_seqs=8 minimal sequences"):
        plan_kv_cache([mla, cmp], BS, 8, 64, 32, budget_bytes=BS * mla.bytes_per_entry() + 100)
