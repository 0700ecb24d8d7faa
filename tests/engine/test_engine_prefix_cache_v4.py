"""Prefix caching on DeepSeek-V4 (tiny-v4: W=8, CSA m=4, HCA m=16, block size 16), fp32 on the CPU: a request
served from a cached prefix gives the tokens of a run without caching and logprobs within 1e-6, with the
hit across chunk boundaries (chunks of 13 tokens), block boundaries, partial last blocks and prompts far
longer than the window; where the CSA entries end on a block boundary (hit 64) and mid-block (hit 80);
a fully cached prompt; a next turn into generated tokens; preemption and aborts in a small cache. Also:
the refusals that remain, the lower tiers' need of prefix caching, and the snapshot memory in the plan (V4 on the
host / disk tiers: tests/kv/test_kv_v4_tiers.py)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
from deepinfer.backend import KVCacheSpec
from deepinfer.errors import ConfigError
from deepinfer.kv.planner import plan_kv_cache
from deepinfer.kv.prefix_cache import prefix_caching_refusals
from deepinfer.kv.state_snapshots import snapshot_bytes_per_block

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, logprobs=2, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()  # tiny V4 steps are hundreds of small ops: one thread is faster here
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _engine(path: str, caching: bool, **kw) -> DeepInferenceEngine:
    settings = dict(device="cpu", dtype="float32", max_model_len=192, num_kv_blocks=64, max_num_batched_tokens=13,
                    enable_prefix_caching=caching, load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine(EngineConfig(path, **settings))


def _trace(out):
    c = out.outputs[0]
    return list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]


def _close(a, b, tol: float) -> bool:
    """Same tokens; logprobs within 1e-6 relative (or absolute near 0): the suffix runs in other chunk
    shapes than the uncached prefill, the same math in another fp32 summation order."""
    (ta, la), (tb, lb) = a, b
    return ta == tb and all(
        sa.keys() == sb.keys() and all(math.isclose(sa[t], sb[t], rel_tol=tol, abs_tol=tol) for t in sa)
        for sa, sb in zip(la, lb))


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


def _check_pools(engine) -> None:
    for pool in engine.kv.pools.values():
        pool.check()
        assert not any(pool.ref)  # nothing held once every request is gone


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v4")


_ENGINES: dict[int, tuple] = {}


@pytest.fixture(scope="module")
def engines(path):
    """(cached, plain) engines per token budget, built once."""
    def get(budget: int = 13):
        if budget not in _ENGINES:
            _ENGINES[budget] = _engine(path, True, max_num_batched_tokens=budget), \
                _engine(path, False, max_num_batched_tokens=budget)
        return _ENGINES[budget]
    yield get
    _ENGINES.clear()


@pytest.mark.parametrize("budget,shared,suffix_len", [(16, 70, 1), (16, 86, 37), (32, 86, 5), (13, 70, 16),
                                                      (13, 86, 37)])
def test_hit_gives_the_same_tokens_and_logprobs(engines, budget, shared, suffix_len):
    """A hit of 64 (CSA: 16 entries, a full block; HCA: 4, a partial one) or 80 tokens (both partial), then a
    suffix of a partial block, exactly a block, or several chunks. Chunks of 16 tokens: the hit and the miss
    compute every token in the same shapes, so they are bitwise equal. 32: the snapshot of 80 is taken
    inside a step ([64, 87)), and the miss computes [80, 96) inside the step [64, 96), the hit as a step of
    its own; 13: the chunks fall elsewhere in the two runs. Both only reorder fp32 sums: within 2e-6
    relative (1.2e-6 measured)."""
    cached, plain = engines(budget)
    prefix = _tokens(shared, shared)
    cached.generate([prefix + [7]], GREEDY, use_tqdm=False)
    prompt = prefix + _tokens(suffix_len, 100 + suffix_len)
    got = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == shared // 16 * 16
    want = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
    if budget == 16:
        assert _trace(got) == _trace(want)
    else:
        assert _close(_trace(got), _trace(want), tol=2e-6)
    _check_pools(cached)


def test_fully_cached_prompt_and_next_turn(engines):
    """The same prompt twice hits all but its last block; the next turn (prompt + output + more) hits into
    the generated tokens."""
    cached, plain = engines(16)
    prompt = _tokens(48, 5)
    first = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 32
    assert _trace(again) == _trace(first)
    turn = prompt + list(first.outputs[0].token_ids) + _tokens(19, 6)
    got = cached.generate([turn], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 48  # 54 tokens were computed (the last output token was not): 3 blocks
    assert _close(_trace(got), _trace(plain.generate([turn], GREEDY, use_tqdm=False)[0]), tol=2e-6)
    _check_pools(cached)


def test_preemption_and_aborts_in_a_small_cache(path, engines):
    """8 requests on two shared prefixes in a cache too small for them all: sequences are preempted and
    come back through their own cached blocks, one is aborted mid-prompt; every finished request matches
    the uncached run, and no block is left held."""
    _, plain = engines(32)
    e = _engine(path, True, num_kv_blocks=8, max_num_batched_tokens=32, max_model_len=96)
    heads = [_tokens(40, 11), _tokens(24, 12)]
    prompts = [heads[i % 2] + _tokens(3 + i, 20 + i) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1, ignore_eos=True)
    ids = [f"r{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        e.add_request(rid, p, params)
    e.step()
    e.abort_request("r5")
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    st = e.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hit_tokens > 0
    assert "r5" not in done
    for rid, p in zip(ids, prompts):
        if rid == "r5":
            continue
        # batched here, alone there: without batch invariance a batch alone moves a logprob by up to ~7e-6
        # (tests/engine/test_engine_prefix_cache.py compares its batched run at 1e-5 for the same reason)
        assert _close(_trace(done[rid]), _trace(plain.generate([p], params, use_tqdm=False)[0]), tol=1e-5)
    assert st.kv_blocks_used == 0
    _check_pools(e)


def test_refusals_and_tiers(path):
    """V4's groups are served; a layout the snapshots cannot follow is refused with the reason; the lower
    tiers need prefix caching."""
    f = torch.float32
    swa = KVCacheSpec("w", (0,), (4,), f, sliding_window=8)
    comp = KVCacheSpec("c", (0,), (4,), f, tokens_per_entry=4, state_shape=(8, 8))
    assert prefix_caching_refusals([swa, comp]) == []
    assert "exactly one sliding-window group" in " ".join(prefix_caching_refusals([comp]))
    assert "compressed sliding window" in " ".join(
        prefix_caching_refusals([KVCacheSpec("w", (0,), (4,), f, tokens_per_entry=2, sliding_window=8)]))
    assert "without compression" in " ".join(
        prefix_caching_refusals([swa, KVCacheSpec("s", (0,), (4,), f, state_shape=(2, 2))]))
    with pytest.raises(ConfigError, match="needs prefix caching"):
        _engine(path, False, kv_host_cache_gib=0.01)


def test_snapshot_bytes_count_in_the_plan():
    """With the snapshots' bytes charged to each window block, a budget buys fewer tokens."""
    f = torch.float32
    specs = [KVCacheSpec("w", (0, 1), (32,), f, sliding_window=8),
             KVCacheSpec("c", (1,), (32,), f, tokens_per_entry=4, state_shape=(8, 128))]
    per = snapshot_bytes_per_block(specs, 16)
    assert per == 8 * 128 * 4 + 16 * 32 * 4
    plain = plan_kv_cache(specs, 16, 4, 4096, 64, budget_bytes=2**18)
    snap = plan_kv_cache(specs, 16, 4, 4096, 64, budget_bytes=2**18, snapshot_bytes_per_block=per)
    assert snap.bytes_total <= 2**18 and snap.capacity_tokens < plain.capacity_tokens
