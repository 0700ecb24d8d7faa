"""Prefix caching end to end (cpu backend, fp32): a request served from cached blocks gives the tokens it gets
without caching, logprobs within 1e-6 (bitwise with batch_invariant), across block and chunk boundaries,
partial last blocks, preemption and aborts; hit counts reach RequestOutput; V4 is on by default."""

from __future__ import annotations

import math
import random

import pytest

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

BS = 16
SYSTEM = [0] + [(13 * i + 7) % 900 + 2 for i in range(47)]  # 48 tokens: three full blocks
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, logprobs=2, ignore_eos=True)


def _engine(path: str, caching: bool, **kw) -> DeepInferenceEngine:
    settings = dict(device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64, max_num_batched_tokens=40,
                    enable_prefix_caching=caching, load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine(EngineConfig(path, **settings))


def _trace(out):
    c = out.outputs[0]
    return list(c.token_ids), [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs]


def _close(a, b, tol=4e-6) -> bool:
    """Same tokens; logprobs within 4e-6 relative (or absolute, near 0). The suffix of a hit is computed
    as a chunk on top of cached context, where the uncached run may compute it in a prefill of another
    shape or a decode step (the absorbed form), and the cached prefix's KV came from a prefill of another
    length: the same math in another fp32 summation order. Measured: up to 1.0e-6 relative (2.1e-6 absolute,
    9 ulps of a logprob near -2.1) on an AVX-512 EPYC (2026-12-02), under 1e-6 on the box before; the issue's
    1e-6 is what batch_invariant gives, bitwise (test below)."""
    (ta, la), (tb, lb) = a, b
    return ta == tb and all(
        sa.keys() == sb.keys() and all(math.isclose(sa[t], sb[t], rel_tol=tol, abs_tol=tol) for t in sa)
        for sa, sb in zip(la, lb))


@pytest.fixture(scope="module")
def path(checkpoint):
    return checkpoint("tiny-v3")


@pytest.fixture(scope="module")
def engines(path):
    return _engine(path, True), _engine(path, False)


def _suffix(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 1000) for _ in range(n)]


@pytest.mark.parametrize("suffix_len", [1, 5, 16, 37])  # partial last block, exactly a block, beyond a chunk
def test_hit_gives_the_same_tokens_and_logprobs(engines, suffix_len):
    cached, plain = engines
    warm = cached.generate([SYSTEM + _suffix(3, 99)], GREEDY, use_tqdm=False)[0]
    assert warm.num_cached_tokens is not None
    prompt = SYSTEM + _suffix(suffix_len, suffix_len)
    got = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    want = plain.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert got.num_cached_tokens == 48 and want.num_cached_tokens == 0
    assert _close(_trace(got), _trace(want))


def test_whole_prompt_cached_still_computes_its_last_block(engines):
    cached, plain = engines
    prompt = SYSTEM + _suffix(16, 5)  # 64 tokens = four full blocks
    cached.generate([prompt], GREEDY, use_tqdm=False)
    again = cached.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48  # the last full block is recomputed, so the first logits exist
    assert _close(_trace(again), _trace(plain.generate([prompt], GREEDY, use_tqdm=False)[0]))
    # the generated tokens were cached too: prompt + output as a prompt hits past the original prompt
    longer = prompt + list(again.outputs[0].token_ids) + _suffix(9, 6)
    hit = cached.generate([longer], GREEDY, use_tqdm=False)[0]
    assert hit.num_cached_tokens == (len(prompt) + 8) // BS * BS
    assert _close(_trace(hit), _trace(plain.generate([longer], GREEDY, use_tqdm=False)[0]))


def test_many_requests_with_shared_prefixes_preemption_and_aborts(path):
    """A small cache (20 blocks for up to 8 sequences) forces preemption and eviction; an aborted request
    leaves nothing wrong behind."""
    cached = _engine(path, True, num_kv_blocks=20, max_num_seqs=8)
    plain = _engine(path, False, num_kv_blocks=64)
    rng = random.Random(3)
    prefixes = [SYSTEM, SYSTEM[:20], _suffix(33, 1)]
    prompts = [rng.choice(prefixes) + _suffix(rng.randint(1, 40), 100 + i) for i in range(24)]
    params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 12), logprobs=1, ignore_eos=True)
              for _ in prompts]
    cached.add_request("gone", SYSTEM + _suffix(30, 7), SamplingParams(max_tokens=50, ignore_eos=True))
    cached.step()
    cached.abort_request("gone")
    got = cached.generate(prompts, params, use_tqdm=False)
    want = plain.generate(prompts, params, use_tqdm=False)
    # the two runs batch differently (other cache sizes, other preemptions), and without batch invariance a
    # batch alone moves a logprob by up to ~7e-6 (tests/engine/test_engine_batch_invariance.py's negative
    # control), so this compares at 1e-5; the bitwise comparison is the batch-invariant test below
    for g, w in zip(got, want):
        assert _close(_trace(g), _trace(w), tol=1e-5), g.request_id
    st = cached.stats()
    assert st.num_preemptions > 0 and st.prefix_cache_hit_tokens > 0
    assert st.kv_blocks_used == 0 and st.prefix_cache_blocks > 0  # all freed; cached blocks stay findable
    assert sum(o.num_cached_tokens for o in got) > 0


def test_bitwise_with_batch_invariance(path):
    cached = _engine(path, True, batch_invariant=True)
    plain = _engine(path, False, batch_invariant=True)
    params = SamplingParams(temperature=0.8, seed=11, max_tokens=8, logprobs=2, ignore_eos=True)
    cached.generate([SYSTEM + _suffix(4, 1)], params, use_tqdm=False)
    prompt = SYSTEM + _suffix(21, 2)
    got = cached.generate([prompt], params, use_tqdm=False)[0]
    assert got.num_cached_tokens == 48
    assert _trace(got) == _trace(plain.generate([prompt], params, use_tqdm=False)[0])


def test_v4_defaults_on(checkpoint):
    """V4's hybrid cache is served since bounded replay landed (tests/engine/test_engine_prefix_cache_v4*.py)."""
    e = _engine(checkpoint("tiny-v4"), None, max_num_batched_tokens=256)
    assert e.kv.prefix_caching and e.kv.hybrid and e.kv.snapshots is not None


def test_v3_defaults_on(path):
    assert _engine(path, None).kv.prefix_caching
