"""Batch-invariant inference end to end on the nvidia backend (EngineConfig(batch_invariant=True)), on a GPU.

The needle test: one prompt alone, then at a random place among ~64 other prompts of random lengths (the
token budget forces chunked prefill of the long ones), at T=0 and at T=0.8 with a seed: token ids and every
step's logprobs are equal, exactly. Also CUDA graphs on == off and async scheduling on == off, and the
negative control: with the flag off the same crowd changes the needle's logprobs. bf16 (tiny-v2-lite's
shapes), where the default kernels' tile choices show.

  python -m pytest -q tests/engine/test_engine_batch_invariance_gpu.py
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu

TARGET = [0] + [(37 * i + 11) % 1000 + 2 for i in range(299)]  # 300 tokens: chunked at a budget of 256
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.95, seed=1234, max_tokens=24, logprobs=3, ignore_eos=True),
}


def _trace(out) -> tuple[list[int], list[list[tuple[int, float, int]]]]:
    c = out.outputs[0]
    return list(c.token_ids), [sorted((t, lp.logprob, lp.rank) for t, lp in step.items()) for step in c.logprobs]


def _others(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 1000) for _ in range(rng.choice([3, 17, 60, 130, 300, 700]) - 1)]
            for _ in range(n)]


def _engine(path: str, **kw) -> DeepInferenceEngine:
    settings = dict(device="cuda", dtype="bfloat16", batch_invariant=True, max_num_batched_tokens=256,
                    max_model_len=1024, max_num_seqs=96, num_kv_blocks=512, load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine(EngineConfig(path, **settings))


@pytest.fixture(scope="module")
def path(checkpoint):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return checkpoint("tiny-v2-lite")


@pytest.fixture(scope="module")
def engine(path):
    return _engine(path)


def _crowd(engine, params, rng, n_others: int, seed: int):
    others = _others(n_others, seed)
    place = rng.randint(0, len(others))
    mates = [SamplingParams(temperature=rng.choice([0.0, 0.7, 1.2]), max_tokens=rng.randint(1, 40),
                            seed=rng.randint(0, 9), ignore_eos=True) for _ in others]
    outs = engine.generate(others[:place] + [TARGET] + others[place:], mates[:place] + [params] + mates[place:],
                           use_tqdm=False)
    return _trace(outs[place])


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_needle_alone_equals_needle_in_a_crowd(engine, kind):
    params = PARAMS[kind]
    assert engine.runner.graph_runner is not None, "expected decode CUDA graphs"
    alone = _trace(engine.generate([TARGET], params, use_tqdm=False)[0])
    rng = random.Random(7 if kind == "greedy" else 8)
    for trial in range(2):
        assert _crowd(engine, params, rng, rng.randint(48, 80), 100 * trial + len(kind)) == alone, (kind, trial)


def test_prefill_logprobs_equal_decode_logprobs(engine):
    tokens, steps = _trace(engine.generate([TARGET], PARAMS["greedy"], use_tqdm=False)[0])
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=3, ignore_eos=True)
    for k in (1, 9, 23):
        assert _trace(engine.generate([TARGET + tokens[:k]], one, use_tqdm=False)[0]) == (tokens[k: k + 1],
                                                                                          steps[k: k + 1]), k


@pytest.mark.parametrize("setting", [{"enforce_eager": True}, {"async_scheduling": False}])
def test_graphs_and_async_scheduling_do_not_change_the_bits(path, engine, setting):
    other = _engine(path, **setting)
    prompts = [TARGET] + _others(20, seed=3)
    params = [PARAMS["seeded"]] + [PARAMS["greedy"]] * 20
    got = [_trace(o) for o in other.generate(prompts, params, use_tqdm=False)]
    want = [_trace(o) for o in engine.generate(prompts, params, use_tqdm=False)]
    assert got == want, setting
    del other


def test_negative_control_flag_off_differs_somewhere(path):
    """Without the flag the default kernels pick tiles, splits and MoE modes from the batch, so the crowd
    changes the needle's logprobs: the needle test above can see what batch invariance removes."""
    e = _engine(path, batch_invariant=False)
    alone = _trace(e.generate([TARGET], PARAMS["greedy"], use_tqdm=False)[0])
    rng = random.Random(5)
    assert any(_crowd(e, PARAMS["greedy"], rng, 64, seed) != alone for seed in (1, 2, 3))
