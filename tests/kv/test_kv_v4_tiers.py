"""V4's hybrid cache on the host and disk tiers (tiny-v4: W=8, CSA m=4, HCA m=16, block size 16; fp32, CPU).

Evicted window blocks (with the compressor-state snapshot slot beside each) and compressed blocks go to the
host tier, then disk; a later hit reads them back into fresh device blocks. A hit served from the host tier,
and one from the disk after a restart, must give the tokens and logprobs of an uncached run."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()  # tiny V4 steps are hundreds of small ops: one thread is faster here
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(path: str, **kw) -> DeepInferenceEngine:
    settings = dict(device="cpu", dtype="float32", max_model_len=160, num_kv_blocks=10, max_num_batched_tokens=16,
                    max_num_seqs=2,  # small compressed pools, so their blocks are evicted too
                    load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine(EngineConfig(path, **settings))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def _trace(out):
    c = out.outputs[0]
    return list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]


PREFIX = _tokens(70, 1)  # a hit of 64 tokens: CSA 16 entries (one full block), HCA 4 (a partial block)
PROMPT = PREFIX + _tokens(9, 2)


def _fill(e: DeepInferenceEngine, n: int = 3) -> None:
    """Cache PREFIX, then push it out of the small device cache with other prompts."""
    e.generate([PREFIX + [7]], GREEDY, use_tqdm=False)
    for i in range(n):
        e.generate([_tokens(120, 50 + i)], GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v4")


@pytest.fixture(scope="module")
def want(path):
    return _trace(_engine(path, enable_prefix_caching=False).generate([PROMPT], GREEDY, use_tqdm=False)[0])


def _check_pools(e) -> None:
    for pool in e.kv.pools.values():
        pool.check()
        assert not any(pool.ref)


def test_a_host_tier_hit_equals_a_miss(path, want):
    e = _engine(path, kv_host_cache_gib=0.01)
    _fill(e)
    window = e.kv.window_group
    assert not any(e.kv.pools[window].block_of.get(k) is not None for k in e.kv.block_keys(_Seq(PROMPT), 4)), \
        "the prefix's window blocks should have left the device cache"
    out = e.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64
    assert e.kv.prefix_tier_hit_tokens > 0, "the hit should come back from the host tier"
    # the same chunks fall at the same places (budget 16 = the block size): bitwise equal to the miss
    assert _trace(out) == want
    _check_pools(e)


def test_a_disk_hit_after_a_restart_equals_a_miss(path, want, tmp_path):
    disk = str(tmp_path / "kv")
    filler = _engine(path, kv_disk_cache_dir=disk)
    _fill(filler, 6)  # without a host tier only evicted blocks reach the disk: push every prefix block out
    filler.kv.disk_tier.flush()
    fresh = _engine(path, kv_disk_cache_dir=disk)  # a restart: an empty device cache, the directory kept
    out = fresh.generate([PROMPT], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and fresh.kv.prefix_tier_hit_tokens > 0
    assert _trace(out) == want
    _check_pools(fresh)


class _Seq:
    """What block_keys reads of a sequence."""

    def __init__(self, tokens):
        self.tokens, self.block_keys = tokens, []

    def token_ids_slice(self, a, b):
        return self.tokens[a:b]
