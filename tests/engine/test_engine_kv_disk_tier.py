"""The prefix cache's disk tier: evicted blocks go to files, a new engine on the same directory hits them and
answers as without caching; a corrupted file is a miss with a warning and correct output; another fingerprint
(model, dtype or block size: here the dtype) never reads them; the size limit holds."""

from __future__ import annotations

import glob
import logging
import math
import os

import pytest

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
from deepinfer.errors import ConfigError

SYSTEM = [0] + [(11 * i + 5) % 900 + 2 for i in range(63)]  # 64 tokens: four blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)


def _engine(path: str, disk: str | None, **kw) -> DeepInferenceEngine:
    settings = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=12, max_num_batched_tokens=64,
                    kv_disk_cache_dir=disk, load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine(EngineConfig(path, **settings))


def _trace(out):
    c = out.outputs[0]
    return list(c.token_ids), [[(t, lp.logprob) for t, lp in step.items()] for step in c.logprobs]


def _close(a, b) -> bool:
    return a[0] == b[0] and all(t1 == t2 and math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-6)
                                for s1, s2 in zip(a[1], b[1]) for (t1, x), (t2, y) in zip(s1, s2))


def _fill(engine: DeepInferenceEngine) -> None:
    """Cache SYSTEM's blocks, then push them out of the 12-block device cache with other prompts."""
    engine.generate([SYSTEM + [7, 8, 9]], GREEDY, use_tqdm=False)
    for i in range(4):
        engine.generate([[0] + [(97 * i + 13 * j) % 900 + 2 for j in range(90)]], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v3")


def test_restart_hits_the_disk_then_a_corrupt_file_is_a_miss(path, tmp_path, caplog):
    disk = str(tmp_path / "kv")
    filler = _engine(path, disk)
    _fill(filler)
    prompt = SYSTEM + [41, 42, 43, 44, 45]
    want = _trace(_engine(path, None, enable_prefix_caching=False).generate([prompt], GREEDY, use_tqdm=False)[0])

    fresh = _engine(path, disk)  # a restart: an empty device cache, yesterday's directory (filler's writes flushed)
    files = glob.glob(os.path.join(disk, "*", "*", "*.kvb"))
    assert files and len(files) == filler.kv.disk_tier.puts, "nothing was evicted to disk, or not all of it written"
    out = fresh.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and fresh.kv.prefix_tier_hit_tokens == 64
    assert _close(_trace(out), want)

    for f in glob.glob(os.path.join(disk, "*", "*", "*.kvb")):  # flip a byte in every payload
        data = bytearray(open(f, "rb").read())
        data[-3] ^= 0xFF
        open(f, "wb").write(bytes(data))
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        again = _engine(path, disk)
        out = again.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and "failed its checks" in caplog.text
    assert _close(_trace(out), want)


def test_another_dtype_never_reads_them(path, tmp_path):
    disk = str(tmp_path / "kv")
    _fill(_engine(path, disk))
    other = _engine(path, disk, dtype="bfloat16")  # another fingerprint (the salt holds the dtype)
    assert other.generate([SYSTEM + [41]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert len(os.listdir(disk)) == 2  # one subdirectory per fingerprint
    # batch-invariant kernels write other bits: their runs must never read a default run's blocks (or the reverse)
    inv = _engine(path, disk, batch_invariant=True)
    assert inv.generate([SYSTEM + [41]], GREEDY, use_tqdm=False)[0].num_cached_tokens == 0
    assert len(os.listdir(disk)) == 3


def test_size_limit_and_config_errors(path, tmp_path):
    disk = str(tmp_path / "kv")
    e = _engine(path, disk, kv_disk_cache_gib=2e-6)  # ~2 KiB: about one block file
    _fill(e)
    e.kv.disk_tier.sweep()
    assert e.kv.disk_tier.size_bytes() <= 2e-6 * 1024**3
    with pytest.raises(ConfigError, match="kv_disk_cache_dir"):
        EngineConfig(path, kv_disk_cache_dir=disk, enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="kv_retention_hours"):
        EngineConfig(path, kv_retention_hours=0)


def test_the_ttft_benchmark_runs(path, tmp_path, monkeypatch, capsys):
    """benchmarks/prefix_cache.py end to end at a tiny context (what it measures is in the perf log)."""
    import json
    import sys

    from benchmarks import prefix_cache

    monkeypatch.setattr(sys, "argv", ["prefix_cache", path, "--context", "40", "--device", "cpu", "--reps", "1",
                                      "--disk", str(tmp_path / "kv")])
    prefix_cache.main()
    row = json.loads(capsys.readouterr().out.splitlines()[0])
    assert row["cached_tokens"] == 32 and row["disk_cached_tokens"] == 32 and row["miss_ms"] > 0


def test_host_tier_hits_and_spills_to_disk(path, tmp_path):
    prompt = SYSTEM + [41, 42, 43, 44, 45]
    want = _trace(_engine(path, None, enable_prefix_caching=False).generate([prompt], GREEDY, use_tqdm=False)[0])
    host_only = _engine(path, None, kv_host_cache_gib=0.01)
    _fill(host_only)
    assert len(host_only.kv.host_tier) > 0
    out = host_only.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and host_only.kv.prefix_tier_hit_tokens == 64
    assert _close(_trace(out), want)
    # a host tier of ~3 blocks: what it pushes out lands on disk, where a restarted engine finds it
    disk = str(tmp_path / "kv")
    small = _engine(path, disk, kv_host_cache_gib=4e-5)
    _fill(small)
    assert small.kv.host_tier.size_bytes <= 4e-5 * 1024**3 and small.kv.disk_tier.puts > 0
    fresh = _engine(path, disk)
    out = fresh.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and _close(_trace(out), want)
    with pytest.raises(ConfigError, match="kv_host_cache_gib"):
        EngineConfig(path, kv_host_cache_gib=-1)


def test_an_idle_engine_does_not_wait_for_the_disk_writes(path, tmp_path):
    """The writer drains its queue in the background: a request that evicts blocks to disk returns while their
    files are still being written (the next request's TTFT no longer pays the fsyncs), and a tier opened on the
    same directory in this process waits for them, so a restart still finds every block."""
    import threading

    from deepinfer.kv.disk_tier import DiskTier
    from deepinfer.worker.kv_block_io import KVBlockIO

    class GatedWrites(DiskTier):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.gate = threading.Event()

        def _write(self, key, host):
            self.gate.wait(30)
            super()._write(key, host)

    disk = str(tmp_path / "kv")
    e = _engine(path, None)
    gated = GatedWrites(disk, 1 << 30, 72.0, e.kv.cache_salt)
    e.kv.attach_tiers(None, gated, KVBlockIO(e.runner.caches, e.kv.specs[0].name))
    _fill(e)  # evicts SYSTEM's blocks to the gated tier: generate returns with their writes pending
    assert gated.puts > 0 and gated._queue.unfinished_tasks > 0
    assert not glob.glob(os.path.join(disk, "*", "*", "*.kvb"))
    opened = []
    opener = threading.Thread(target=lambda: opened.append(DiskTier(disk, 1 << 30, 72.0, e.kv.cache_salt)))
    opener.start()
    opener.join(0.3)
    assert opener.is_alive() and not opened  # the new tier waits for the pending writes...
    gated.gate.set()
    opener.join(30)
    assert opened and len(glob.glob(os.path.join(disk, "*", "*", "*.kvb"))) == gated.puts  # ...then finds them all
