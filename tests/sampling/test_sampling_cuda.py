"""On a CUDA device the counter RNG and the sampler give the CPU's tokens (run on the GPU machine)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.sample import rng
from deepinfer.sample.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _need_cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def test_uniforms_bitwise_equal_on_cuda():
    keys = rng.row_keys_tensor(list(range(64)), list(range(100, 164)))
    assert torch.equal(rng.uniform_tensor(keys, 4096), rng.uniform_tensor(keys.cuda(), 4096).cpu())


def test_sampler_tokens_equal_on_cuda():
    vocab, n = 129280, 48
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * 3
    kinds = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_p=0.9, logprobs=5),
        SamplingParams(temperature=0.8, top_k=50, min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3),
    ]
    rows = [SamplingRow(kinds[i % 4], [1, 2, 3], [i, 7], 1000 + i, 5) for i in range(n)]
    sampler = Sampler(vocab)
    cpu = sampler(logits, rows)
    gpu = sampler(logits.cuda(), rows)
    assert cpu.token_ids == gpu.token_ids
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        if a is not None:
            assert list(a) == list(b)
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def test_seeded_rows_batch_invariant_on_cuda():
    vocab = 129280
    logits = (torch.randn(33, vocab, generator=torch.Generator().manual_seed(1)) * 3).cuda()
    kinds = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_p=0.95),
        SamplingParams(temperature=0.9, top_k=40, top_p=0.8, min_p=0.02),
    ]
    sampler = Sampler(vocab)
    for params in kinds:
        rows = [SamplingRow(kinds[i % 3], [1, 2], [3] * (i % 5), 50 + i, 2 + i % 5) for i in range(33)]
        target = SamplingRow(params, [9, 9, 9], [4], 1234, 4)
        alone = sampler(logits[:1], [target]).token_ids[0]
        for place in (0, 7, 32):
            batch = rows[:place] + [target] + rows[place + 1 :]
            batch_logits = logits.clone()
            batch_logits[place] = logits[0]  # the target keeps its own logits wherever it sits
            assert sampler(batch_logits, batch).token_ids[place] == alone


def test_filter_rows_identical_alone_and_batched_on_cuda():
    from deepinfer.sample.sampler import filter_logits

    vocab, n = 129280, 40
    x = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 4).cuda()
    top_k = torch.tensor([vocab if i % 3 else 20 + i for i in range(n)], device="cuda")
    top_p = torch.tensor([0.5 + 0.0125 * i for i in range(n)], device="cuda")
    min_p = torch.tensor([0.0 if i % 2 else 0.01 for i in range(n)], device="cuda")
    batched = torch.isinf(filter_logits(x, top_k, top_p, min_p))
    for i in range(n):
        alone = torch.isinf(filter_logits(x[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1]))
        assert torch.equal(alone[0], batched[i]), i
