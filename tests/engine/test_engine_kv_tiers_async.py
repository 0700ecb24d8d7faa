"""The KV tiers' copies are asynchronous (kv/tier_copies.py): checked with a backend whose copies run only when
told (QueuedCopies), so what runs before what is deterministic.

- an eviction queues its copy and the host does not wait: right after schedule() the copy has not run and the
  host buffer is still empty; the copy reads a gather of the blocks made on the compute stream before the next
  step, so the launch does not wait for it (the copy overlaps the step) and the forward overwrites the block
  while the copy is still queued, yet the host tier holds the block as it was;
- a host-tier hit served through queued copies gives the miss's tokens and logprobs; a backend that drops the
  compute stream's wait gives wrong ones (the test above can fail);
- a prefix on disk is read on the pool while other requests run; its request is admitted once the reads are
  done, and answers as a miss does;
- the disk writer waits for a block's copy (ready) before it writes, serves queued blocks from memory, and
  flush() leaves the files.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import Future

import pytest
import torch

from deepinfer import EngineConfig, SamplingParams
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.kv.disk_tier import DiskTier
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer
from deepinfer.worker.kv_block_io import KVBlockIO

SYSTEM = [0] + [(11 * i + 5) % 900 + 2 for i in range(63)]  # 64 tokens: four blocks
OTHER = [[0] + [(97 * i + 13 * j) % 900 + 2 for j in range(90)] for i in range(4)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


class QueuedCopies(CPUBackend):
    """The cpu backend with a pretend copy stream: copy_async queues the copy and returns an event id; a copy
    runs only when the compute stream waits for it (wait_event: on the eager CPU, work after that point runs
    after the copy), when the host waits (event_synchronize), or on complete()."""

    def __init__(self, honour_waits: bool = True):
        super().__init__()
        self.honour_waits = honour_waits
        self.queue: list[tuple[int, list, list]] = []
        self.log: list[tuple[str, int]] = []
        self._n = 0

    def copy_stream(self):
        return "side"

    def copy_async(self, dsts, srcs, stream):
        self._n += 1
        self.queue.append((self._n, list(dsts), list(srcs)))
        self.log.append(("queued", self._n))
        return self._n

    def _run_until(self, event: int) -> None:
        while self.queue and self.queue[0][0] <= event:
            n, dsts, srcs = self.queue.pop(0)
            for d, s in zip(dsts, srcs):
                d.copy_(s)
            self.log.append(("ran", n))

    def complete(self) -> None:
        if self.queue:
            self._run_until(self.queue[-1][0])

    def wait_event(self, event):
        self.log.append(("compute waits", event))
        if self.honour_waits:
            self._run_until(event)

    def event_done(self, event):
        return not any(n <= event for n, _, _ in self.queue)

    def event_synchronize(self, event):
        self._run_until(event)


def _engine(path: str, backend, **kw) -> DeepInferenceEngine:
    settings = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=12, max_num_batched_tokens=64,
                    load_progress=False)
    settings.update(kw)
    model = load_model(path, backend, torch.float32, progress=False)
    return DeepInferenceEngine.from_components(EngineConfig(path, **settings), model, Tokenizer.from_pretrained(path),
                                               backend)


def _trace(out):
    c = out.outputs[0]
    return list(c.token_ids), [[(t, lp.logprob) for t, lp in step.items()] for step in c.logprobs]


def _close(a, b) -> bool:
    # a hit's suffix sums in another order than a miss: up to ~1.1e-6 relative measured (2.8e-6 absolute near -2.5),
    # the bound of tests/engine/test_engine_prefix_cache.py (docs/kv-cache.md "Guarantees and limits")
    return a[0] == b[0] and all(t1 == t2 and math.isclose(x, y, rel_tol=4e-6, abs_tol=4e-6)
                                for s1, s2 in zip(a[1], b[1]) for (t1, x), (t2, y) in zip(s1, s2))


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v3")


@pytest.fixture(scope="module")
def want(path):
    prompt = SYSTEM + [41, 42, 43, 44, 45]
    return prompt, _trace(_engine(path, CPUBackend(), enable_prefix_caching=False).generate([prompt], GREEDY,
                                                                                            use_tqdm=False)[0])


def test_an_evicted_block_is_overwritten_only_after_its_copy(path):
    backend = QueuedCopies()
    e = _engine(path, backend, kv_host_cache_gib=0.01, num_kv_blocks=8, max_num_batched_tokens=128)
    e.generate([SYSTEM + [7, 8, 9]], GREEDY, use_tqdm=False)  # SYSTEM's four blocks stay cached (ref 0)
    backend.complete()
    pool = e.kv.pools[e.kv.specs[0].name]
    io = KVBlockIO(e.runner.caches, e.kv.specs[0].name)
    before = {key: (b, [t.clone() for t in io.views(b)]) for key, b in pool.block_of.items()}
    e.add_request("big", OTHER[0] + OTHER[1][:30], GREEDY)  # 121 tokens: all 8 blocks, so the cached are evicted
    sched = e.scheduler.schedule()
    evicted = [k for k in before if e.kv.host_tier.contains(k)]
    assert len(evicted) >= 4 and backend.queue, "the eviction copies should be queued, not run"
    like = io.like()
    for key in evicted:  # the host did not wait: the buffers are still unfilled, the device blocks untouched
        block, old = before[key]
        assert all(torch.equal(d, o) for d, o in zip(io.views(block), old))
    queued = [n for n, _, _ in backend.queue]
    e.runner.launch(sched)
    waits = [n for what, n in backend.log if what == "compute waits"]
    assert not any(n in queued for n in waits) and backend.queue, "the step waited for a copy down"
    for key in evicted:  # the forward overwrote the blocks while their copies were still queued...
        block, old = before[key]
        assert not all(torch.equal(d, o) for d, o in zip(io.views(block), old)), "the step should reuse the block"
    backend.complete()
    for key in evicted:  # ...and the copies, reading the gather made before the step, still hold the old KV
        block, old = before[key]
        assert all(torch.equal(h, o) for h, o in zip(e.kv.host_tier.get(key, like), old))


@pytest.mark.parametrize("honour_waits", [True, False])
def test_host_hit_through_queued_copies_equals_a_miss(path, want, honour_waits):
    prompt, ref = want
    backend = QueuedCopies(honour_waits)
    e = _engine(path, backend, kv_host_cache_gib=0.01)
    e.generate([SYSTEM + [7, 8, 9]], GREEDY, use_tqdm=False)
    for p in OTHER:
        e.generate([p], GREEDY, use_tqdm=False)
    backend.complete()
    out = e.generate([prompt], GREEDY, use_tqdm=False)[0]
    backend.complete()
    assert out.num_cached_tokens == 64 and e.kv.prefix_tier_hit_tokens == 64
    if honour_waits:
        assert _close(_trace(out), ref)
    else:  # without the compute stream's wait the step reads blocks whose copies have not arrived
        assert not _close(_trace(out), ref)


def test_the_cpu_backend_host_and_disk_tiers_equal_a_miss(path, want, tmp_path):
    prompt, ref = want
    e = _engine(path, CPUBackend(), kv_host_cache_gib=4e-5, kv_disk_cache_dir=str(tmp_path / "kv"))
    e.generate([SYSTEM + [7, 8, 9]], GREEDY, use_tqdm=False)
    for p in OTHER:
        e.generate([p], GREEDY, use_tqdm=False)
    assert e.kv.disk_tier.puts > 0 and e.kv._tier.copies.num_to_host > 0
    out = e.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and _close(_trace(out), ref)


class GatedDisk(DiskTier):
    """A disk tier whose reads finish only when the test opens the gate."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.gate = threading.Event()
        self.started = 0

    def read_async(self, key, like):
        self.started += 1
        f: Future = Future()

        def finish():
            self.gate.wait(30)
            f.set_result(self._read(key, like))

        threading.Thread(target=finish, daemon=True).start()
        return f


def test_a_disk_prefix_is_read_while_others_run(path, want, tmp_path):
    prompt, ref = want
    disk = str(tmp_path / "kv")
    filler = _engine(path, CPUBackend(), kv_disk_cache_dir=disk)
    filler.generate([SYSTEM + [7, 8, 9]], GREEDY, use_tqdm=False)
    for p in OTHER:
        filler.generate([p], GREEDY, use_tqdm=False)  # queued for the writer: opening the directory below flushes it
    e = _engine(path, CPUBackend())  # prefix caching on, no tiers yet: attach the gated disk
    gated = GatedDisk(disk, 1 << 30, 72.0, e.kv.cache_salt)
    e.kv.attach_tiers(None, gated, KVBlockIO(e.runner.caches, e.kv.specs[0].name))
    e.add_request("other", OTHER[2][:20], GREEDY)
    e.add_request("hit", prompt, GREEDY)
    e.step()
    assert gated.started >= 4 and [s.request.request_id for s in e.scheduler.waiting] == ["hit"]
    assert e.kv._tier.num_deferred >= 1
    gated.gate.set()
    outs = {}
    while e.has_unfinished_requests():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = o
    assert outs["hit"].num_cached_tokens == 64 and _close(_trace(outs["hit"]), ref)


def test_the_disk_writer_waits_for_the_copy_and_serves_queued_blocks(tmp_path):
    tier = DiskTier(str(tmp_path / "kv"), 1 << 20, 72.0, b"salt")
    gate, order = threading.Event(), []

    def ready():
        gate.wait(30)
        order.append("ready")

    parts = [torch.arange(12, dtype=torch.float32).view(3, 4), torch.ones(2, dtype=torch.bfloat16)]
    tier.put(b"k" * 32, parts, ready)
    assert tier.contains(b"k" * 32) and not os.path.exists(tier._path(b"k" * 32))  # queued, not written
    got = tier.get(b"k" * 32, [torch.empty(3, 4), torch.empty(2, dtype=torch.bfloat16)])
    assert got is not None and torch.equal(got[0], parts[0])
    gate.set()
    tier.flush()
    assert order == ["ready"] and os.path.exists(tier._path(b"k" * 32))
    back = tier.read_async(b"k" * 32, [torch.empty(3, 4), torch.empty(2, dtype=torch.bfloat16)]).result()
    assert all(torch.equal(a, b) for a, b in zip(back, parts))
