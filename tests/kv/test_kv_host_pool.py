"""The host tier's pool (kv/host_pool.py) and batched evictions (tier_link.py, tier_copies.py): the pool is taken
once at start-up through the backend's host buffer service and evictions never allocate after that; one
allocation's evictions are one copy_async call and round-trip bitwise (native copies and a queued copy stream);
a full tier drops or spills its least recently used blocks, never a lent one; bad sizes are named errors."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backend import KVCaches, KVCacheSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.errors import ConfigError
from deepinfer.kv.disk_tier import DiskTier
from deepinfer.kv.host_pool import ALIGN, HostPool, slot_bytes
from deepinfer.kv.host_tier import HostTier, SlotRef
from deepinfer.kv.manager import KVCacheManager
from deepinfer.worker.kv_block_io import KVBlockIO

BS, ENTRY, LAYERS = 4, (6,), (0, 1)


class CountingBackend(CPUBackend):
    """The cpu backend counting its host buffer allocations."""

    def __init__(self):
        super().__init__()
        self.host_buffers = 0

    def host_buffer(self, shape, dtype):
        self.host_buffers += 1
        return super().host_buffer(shape, dtype)


class QueuedBackend(CountingBackend):
    """A pretend copy stream: copies run when the compute stream waits for them or the host synchronizes."""

    def __init__(self):
        super().__init__()
        self.queue: list[tuple[int, list, list]] = []
        self.n = 0

    def copy_stream(self):
        return "side"

    def copy_async(self, dsts, srcs, stream):
        self.n += 1
        self.queue.append((self.n, list(dsts), list(srcs)))
        return self.n

    def _run(self, event):
        while self.queue and self.queue[0][0] <= event:
            _, dsts, srcs = self.queue.pop(0)
            for d, s in zip(dsts, srcs):
                d.copy_(s)

    def wait_event(self, event):
        self._run(event)

    def event_done(self, event):
        return not any(n <= event for n, _, _ in self.queue)

    def event_synchronize(self, event):
        self._run(event)


def _block_bytes() -> int:
    return len(LAYERS) * BS * ENTRY[0] * 4


def _setup(backend, num_blocks: int, host_blocks: int | None, disk: DiskTier | None = None):
    spec = KVCacheSpec("g", LAYERS, ENTRY, torch.float32)
    kv = KVCacheManager([spec], {"g": num_blocks}, BS, 2, num_blocks * BS, prefix_caching=True)
    caches = KVCaches.allocate([spec], {"g": num_blocks}, BS, 2, torch.device("cpu"))
    kv.use_backend(backend)
    layout = [(torch.float32, (BS, *ENTRY))] * 2
    host = None if host_blocks is None else HostTier(host_blocks * slot_bytes(layout) + 2 * ALIGN)
    io = KVBlockIO(caches, "g")
    kv.attach_tiers(host, disk, io)
    return kv, kv.pools["g"], io


def _key(tag: int, i: int) -> bytes:
    return tag.to_bytes(4, "little") + i.to_bytes(4, "little") + bytes(24)


def _fill_and_evict(pool, io, tag: int, n: int) -> dict[bytes, list[torch.Tensor]]:
    """Key n blocks of random KV, free them, then allocate the whole pool (evicting them); returns key -> the KV."""
    blocks = pool.allocate(n)
    want = {}
    for i, b in enumerate(blocks):
        for v in io.views(b):
            v.copy_(torch.randn_like(v))
        pool.register(b, _key(tag, i))
        want[_key(tag, i)] = [v.clone() for v in io.views(b)]
    pool.free(blocks)
    pool.free(pool.allocate(pool.num_free))  # one allocation evicting every keyed block
    return want


@pytest.mark.parametrize("queued", [False, True])
def test_a_batched_eviction_is_one_call_and_round_trips_bitwise(queued):
    backend = QueuedBackend() if queued else CountingBackend()
    kv, pool, io = _setup(backend, 40, 200)
    link = kv._tier
    calls = link.copies.num_calls
    want = _fill_and_evict(pool, io, 1, 40)
    assert link.copies.num_calls - calls == 1, "one allocation's 40 evictions should be one copy_async call"
    assert link.copies.num_to_host == 40 and link.copies.num_transfers <= 2 * 2  # parts x slot runs
    if queued:
        assert backend.queue, "the copy down should be queued, not run"
        kv.fence_tier_copies()  # the launch: the next step does not wait for a copy down...
        assert backend.queue, "the fence waited for a copy down"
        for b in range(pool.num_blocks):  # ...and may overwrite the evicted blocks: the copy reads their gather
            for v in io.views(b):
                v.fill_(-7.0)
        backend.event_synchronize(backend.n)  # the host reads the slots behind their copy's event
    like = io.like()
    for key, kv_bytes in want.items():
        got, ready = link.fetch("g", key)
        assert ready and all(torch.equal(g, w) for g, w in zip(got, kv_bytes))
    fresh = pool.allocate(3)  # and back into device blocks, bit for bit
    keys = list(want)[:3]
    link.load(fresh, keys, [kv.host_tier.get(k, like) for k in keys])
    kv.fence_tier_copies()
    for b, k in zip(fresh, keys):
        assert all(torch.equal(v, w) for v, w in zip(io.views(b), want[k]))


def test_the_pool_never_allocates_after_start_up():
    backend = CountingBackend()
    kv, pool, io = _setup(backend, 16, 24)  # smaller than what is evicted: the tier drops its oldest too
    assert backend.host_buffers == 1, "the host tier's pool: one host buffer at start-up"
    like = io.like()
    for tag in range(6):
        want = _fill_and_evict(pool, io, tag, 16)
        key = next(iter(want))
        got = kv.host_tier.get(key, like)
        if got is not None:
            fresh = pool.allocate(1)
            kv._tier.load(fresh, [key], [got])
            kv.fence_tier_copies()
            pool.free(fresh)
    assert kv._tier.copies.num_to_host == 96 and len(kv.host_tier) == 24
    assert backend.host_buffers == 1, "evictions and hits allocated host buffers after start-up"


def test_a_full_tier_drops_its_oldest_but_never_a_lent_block():
    kv, pool, io = _setup(CountingBackend(), 8, 8)
    host = kv.host_tier
    old = _fill_and_evict(pool, io, 1, 8)
    lent = list(old)[0]
    assert host.get(lent, io.like()) is not None  # a hit holds it, not yet loaded
    new = _fill_and_evict(pool, io, 2, 8)  # needs every slot: all but the lent one are pushed out, one is dropped
    assert host.contains(lent), "a lent block was pushed out under its hit"
    assert sum(host.contains(k) for k in old) == 1 and host.dropped == 1
    assert sum(host.contains(k) for k in new) == 7
    kv.fence_tier_copies()  # the step launched: the hit dropped or loaded, the slot lent no longer
    _fill_and_evict(pool, io, 3, 8)
    assert not host.contains(lent) and len(host) == 8


def test_a_full_tier_spills_its_oldest_to_disk_and_gets_the_slots_back(tmp_path):
    disk = DiskTier(str(tmp_path / "kv"), 1 << 30, 72.0, b"salt")
    kv, pool, io = _setup(CountingBackend(), 8, 8, disk)
    host, link = kv.host_tier, kv._tier
    first = _fill_and_evict(pool, io, 1, 8)
    assert len(host) == 8 and disk.puts == 0
    # full: the oldest move to disk; their slots stay the writer's until written, so this batch spills to disk too
    second = _fill_and_evict(pool, io, 2, 8)
    assert not any(host.contains(k) for k in first) and host.dropped == 0 and link.num_spilled == 8
    disk.flush()  # written: the slots are free again, the next batch lands in host memory
    assert host.pool.num_free("g") == 8
    third = _fill_and_evict(pool, io, 3, 4)
    assert all(host.contains(k) for k in third)
    for key, kv_bytes in {**first, **second, **third}.items():  # wherever it went, it reads back bitwise
        got, ready = link.fetch("g", key)
        assert got is not None and all(torch.equal(g, w) for g, w in zip(got, kv_bytes)), key
    assert all(disk.contains(k) for k in list(first) + list(second))


def test_host_pool_sizes_are_named_errors():
    layout = [(torch.float32, (BS, *ENTRY))] * 2
    with pytest.raises(ConfigError, match="--kv-host-cache-gib.*cannot hold one block"):
        HostPool(100, {"g": layout}, {"g": 1.0}, CPUBackend().host_buffer)
    with pytest.raises(ConfigError, match="--kv-host-cache-gib.*host memory available"):
        HostPool(1 << 60, {"g": layout}, {"g": 1.0}, CPUBackend().host_buffer)

    def fails(shape, dtype):
        raise RuntimeError("cudaHostAlloc failed")

    with pytest.raises(ConfigError, match="--kv-host-cache-gib: cannot allocate"):
        HostPool(1 << 20, {"g": layout}, {"g": 1.0}, fails)
    pool = HostPool(10 * slot_bytes(layout) + 2 * ALIGN, {"g": layout}, {"g": 1.0}, CPUBackend().host_buffer)
    assert pool.groups["g"].num_slots == 10 and pool.take("g", 3) == [0, 1, 2]


class _Seq:
    """What admission reads of a sequence (sched/request.Sequence's fields)."""

    def __init__(self, sid: str, tokens: list[int]):
        self.seq_id, self.prompt_token_ids, self.output_token_ids = sid, tokens, []
        self.num_tokens, self.num_computed_tokens, self.block_keys = len(tokens), 0, []

    def token_ids_slice(self, a, b):
        return self.prompt_token_ids[a:b]


@pytest.mark.parametrize("queued", [False, True])
def test_a_host_hit_is_one_transfer_per_part_into_blocks_placed_in_slot_order(queued):
    """8 blocks evicted to the host tier by one allocation, then hit by the same prompt through the manager: the
    hit lends their slots (no views), places them on its fresh blocks in slot order, and copies them up in one
    call of one transfer per cache part (with a copy stream too: before, one transfer per block and part there);
    the table and the keys name the placed blocks, and the KV read back is the KV evicted, bit for bit."""
    backend = QueuedBackend() if queued else CountingBackend()
    kv, pool, io = _setup(backend, 12, 20)
    link = kv._tier
    tokens = list(range(2, 2 + 8 * BS + 1))  # 8 full blocks and one token
    a = _Seq("a", tokens)
    kv.allocate(a, len(tokens))
    want = {}
    for j, b in enumerate(kv.block_table("a", "g")[:8]):
        for v in io.views(b):
            v.copy_(torch.randn_like(v))
        want[j] = [v.clone() for v in io.views(b)]
    a.num_computed_tokens = len(tokens)
    kv.register_computed(a)
    kv.free(a)
    pool.free(pool.allocate(pool.num_free))  # evicts the 8 keyed blocks: one batch, 8 consecutive host slots
    kv.fence_tier_copies()
    b = _Seq("b", tokens)
    hit = kv.match_prefix(b)
    assert hit.num_tokens == 8 * BS and hit.blocks["g"] == [] and len(hit.tier_parts) == 8
    assert all(isinstance(p, SlotRef) for p in hit.tier_parts)
    calls, transfers = link.copies.num_calls, link.copies.num_transfers
    b.num_computed_tokens = hit.num_tokens
    kv.allocate(b, 1, hit)
    kv.fence_tier_copies()
    assert link.copies.num_calls - calls == 1 and link.copies.num_transfers - transfers == len(io.parts)
    table = kv.block_table("b", "g")[:8]
    # placed in slot order on consecutive fresh blocks; the leaf was evicted first (a sequence frees its blocks last
    # first), so its slots, and the blocks placed on them, descend along the prefix
    assert table == list(range(table[0], table[0] - 8, -1)), table
    keys = kv.block_keys(b, 8)
    for j, blk in enumerate(table):
        assert pool.block_of[keys[j]] == blk
        assert all(torch.equal(v, w) for v, w in zip(io.views(blk), want[j])), j
