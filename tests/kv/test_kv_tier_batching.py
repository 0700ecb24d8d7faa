"""A host-tier hit's copies up are batched: blocks that land in consecutive device blocks go in one transfer per
cache part, and the whole hit in one copy_async call; the KV read back is the KV evicted. Also the window
rollback margin: trims keep it, rollback within it works, beyond it is refused."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend import KVCacheSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.errors import DeepInferError
from deepinfer.kv.host_tier import HostTier
from deepinfer.kv.manager import KVCacheManager
from deepinfer.kv.planner import window_blocks_per_seq
from deepinfer.kv.prefix_cache import CachingBlockPool
from deepinfer.kv.tier_copies import TierCopies
from deepinfer.kv.tier_link import TierLink


class _IO:
    """Two layers' parts, [num_blocks, block_size, width] each (what worker/kv_block_io.KVBlockIO exposes)."""

    def __init__(self, num_blocks: int):
        self.parts = [torch.zeros(num_blocks, 4, 3), torch.zeros(num_blocks, 4, 5)]

    def like(self):
        return [torch.empty(p.shape[1:]) for p in self.parts]

    def views(self, b):
        return [p[b] for p in self.parts]

    def range_views(self, first, n):
        return [p[first: first + n] for p in self.parts]

    def check(self, parts):
        assert len(parts) == len(self.parts)


def _link(num_blocks: int = 16):
    pool, io = CachingBlockPool(num_blocks, "g"), _IO(num_blocks)
    return TierLink(HostTier(1 << 20), None, {"g": io}, {"g": pool}, TierCopies(CPUBackend())), pool, io


@pytest.mark.parametrize("blocks,runs", [([3, 4, 5, 6], 1), ([9, 2, 3, 10], 2), ([1, 5, 8], 3)])
def test_a_hit_is_one_call_and_one_transfer_per_part_per_run(blocks, runs):
    link, pool, io = _link()
    payloads = [[torch.randn(4, 3), torch.randn(4, 5)] for _ in blocks]
    taken = pool.allocate(16)  # hold every block (register needs a holder)
    keys = [bytes([i]) * 32 for i in range(len(blocks))]
    calls = link.copies.num_calls
    link.load(blocks, keys, payloads, group="g")
    assert link.copies.num_calls - calls == 1
    assert link.copies.num_transfers == runs * len(io.parts)  # not len(blocks) * parts
    assert link.copies.num_to_device == len(blocks)
    for b, payload, key in zip(blocks, payloads, keys):
        assert all(torch.equal(v, p) for v, p in zip(io.views(b), payload))
        assert pool.block_of[key] == b
    assert len(taken) == 16


def test_evicted_then_loaded_round_trip():
    """A block evicted to the host tier comes back bit for bit into another device block."""
    link, pool, io = _link(4)
    (b,) = pool.allocate(1)
    for p in io.views(b):
        p.copy_(torch.randn_like(p))
    before = [v.clone() for v in io.views(b)]
    pool.register(b, b"k" * 32)
    pool.free([b])
    pool.allocate(4)  # evicts b: its copy goes down
    got, ready = link.fetch("g", b"k" * 32)
    assert ready and all(torch.equal(g, o) for g, o in zip(got, before))
    pool.free([0, 1, 2, 3])
    (fresh,) = pool.allocate(1)
    link.load([fresh], [b"k" * 32], [got], group="g")
    assert all(torch.equal(v, o) for v, o in zip(io.views(fresh), before))


class _S:
    def __init__(self, sid):
        self.seq_id, self.num_computed_tokens = sid, 0


def test_window_rollback_margin():
    """window_rollback_tokens=R: a sequence keeps R tokens behind its window, so a rollback by up to R works
    and one beyond is refused with the reason; the planner counts the margin."""
    spec = KVCacheSpec("swa", (0,), (4,), torch.float32, sliding_window=8)
    with pytest.raises(DeepInferError, match="window_rollback_tokens"):
        KVCacheManager([spec], {"swa": 64}, 4, 2, 256, window_rollback_tokens=-1)
    kv = KVCacheManager([spec], {"swa": 64}, 4, 2, 256, window_rollback_tokens=12)
    plain = KVCacheManager([spec], {"swa": 64}, 4, 2, 256)
    for m in (kv, plain):
        s = _S("a")
        m.allocate(s, 40)
        s.num_computed_tokens = 40
        m.trim(s)
    # at 40: the window needs tokens >= 33 (block 8); with R=12 tokens >= 21 (block 5)
    assert plain.block_table("a", "swa")[:8] == [-1] * 8 and plain.block_table("a", "swa")[8] >= 0
    assert kv.block_table("a", "swa")[:5] == [-1] * 5 and all(b >= 0 for b in kv.block_table("a", "swa")[5:])
    with pytest.raises(DeepInferError, match="window blocks"):
        plain.rollback(_S("a"), 30)
    with pytest.raises(DeepInferError, match="window blocks"):
        kv.rollback(_S("a"), 26)  # needs tokens >= 19: block 4, returned
    kv.rollback(_S("a"), 28)  # needs tokens >= 21: held
    assert len(kv.block_table("a", "swa")) == 7 and kv.pools["swa"].num_used == 2
    assert window_blocks_per_seq(spec, 4, 1, 12) == window_blocks_per_seq(spec, 4, 13)
