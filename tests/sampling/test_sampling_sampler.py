"""The sampler: batch invariance of seeded rows, distributions, penalties, greedy, logprobs.

References: Hugging Face transformers' logits processors (test-only import) and hand-computed
values; distributions are checked with scipy's chi-square test.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from deepinfer import SamplingParams
from deepinfer.errors import DeepInferError
from deepinfer.sample.penalties import apply_penalties
from deepinfer.sample.sampler import Sampler, SamplingRow, filter_logits

V = 64


def _logits(step: int, n: int = 1, vocab: int = V) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, vocab, generator=g) * 2


def _row(params: SamplingParams, seed: int = 0, prompt=(1, 2, 3), output=()) -> SamplingRow:
    prompt, output = list(prompt), list(output)
    return SamplingRow(params, prompt, output, seed, len(prompt) + len(output))


# ------------------------------------------------------------------ batch invariance / seeds


def _run_request(params: SamplingParams, seed: int, steps: int, batch_others: int,
                 mate_seed: int = 77) -> tuple[list[int], list]:
    """Generate `steps` tokens for one request; other rows (different params, lengths, seeds mate_seed + j)
    share its batches."""
    sampler = Sampler(V)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.2, top_k=5, repetition_penalty=1.5),
        SamplingParams(temperature=0.7, top_p=0.5, presence_penalty=1.0, logprobs=5),
        SamplingParams(temperature=1.0, min_p=0.2, frequency_penalty=0.5),
        SamplingParams(temperature=0.3, top_k=3, top_p=0.9),
    ]
    prompt = [5, 6, 7, 8]
    out: list[int] = []
    lps = []
    other_outs = [[] for _ in range(batch_others)]
    for step in range(steps):
        target = SamplingRow(params, prompt, list(out), seed, len(prompt) + len(out))
        rows, logits = [], []
        place = step % (batch_others + 1)  # the target moves around the batch
        for j in range(batch_others):
            o_prompt = list(range(3 + 5 * j))
            rows.append(SamplingRow(others[j % len(others)], o_prompt, other_outs[j], mate_seed + j,
                                    len(o_prompt) + step))
            logits.append(_logits(500 + 31 * step + j))
        rows.insert(place, target)
        logits.insert(place, _logits(step))
        res = sampler(torch.cat(logits), rows)
        out.append(res.token_ids[place])
        lps.append(res.logprobs[place])
        for j in range(batch_others):
            k = j if j < place else j + 1
            other_outs[j].append(res.token_ids[k])
    return out, lps


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.8, top_k=10, top_p=0.9, min_p=0.02, seed=1, logprobs=3),
        SamplingParams(temperature=1.1, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2, seed=1),
    ],
)
def test_seeded_row_same_alone_and_in_batches(params):
    alone, lp_alone = _run_request(params, seed=42, steps=24, batch_others=0)
    for others in (1, 3, 7):
        batched, lp_batched = _run_request(params, seed=42, steps=24, batch_others=others)
        assert batched == alone, f"batch of {others + 1} changed the seeded tokens"
        if params.logprobs is not None:
            for a, b in zip(lp_alone, lp_batched):
                assert list(a) == list(b)
                for t in a:
                    assert a[t].rank == b[t].rank and math.isclose(a[t].logprob, b[t].logprob, abs_tol=1e-5)


def test_seeded_row_independent_of_its_batch_mates_seeds():
    p = SamplingParams(temperature=0.9, top_p=0.95, seed=3, logprobs=2)
    alone, lp_alone = _run_request(p, seed=42, steps=24, batch_others=0)
    for mate_seed in (0, 42, 2**40 + 7):  # including mates with the target's own seed
        got, lp = _run_request(p, seed=42, steps=24, batch_others=5, mate_seed=mate_seed)
        assert got == alone, mate_seed
        assert [{t: (x.logprob, x.rank) for t, x in a.items()} for a in lp] == \
               [{t: (x.logprob, x.rank) for t, x in a.items()} for a in lp_alone]


def test_different_seeds_differ_and_same_seed_repeats():
    p = SamplingParams(temperature=1.0)
    a, _ = _run_request(p, seed=1, steps=32, batch_others=0)
    b, _ = _run_request(p, seed=2, steps=32, batch_others=0)
    a2, _ = _run_request(p, seed=1, steps=32, batch_others=2)
    assert a == a2
    assert a != b
    assert sum(x != y for x, y in zip(a, b)) > 16


# ------------------------------------------------------------------ distributions


def _hf_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    x = TemperatureLogitsWarper(temperature)(ids, logits.clone())
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(ids, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(ids, x)
    if min_p > 0:
        x = MinPLogitsWarper(min_p)(ids, x)
    return x


DIST_CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, min_p=0.15),
    dict(temperature=0.9, top_k=9, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("cfg", DIST_CONFIGS)
def test_empirical_distribution_matches_reference(cfg):
    vocab, draws = 12, 100_000
    base = torch.tensor([[1.0, 0.5, 2.0, -1.0, 0.0, 1.5, 0.3, -0.5, 2.2, 0.8, -2.0, 1.1]])
    params = SamplingParams(**cfg)
    ref = _hf_filtered(base, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    expected = torch.softmax(ref, dim=-1)[0].double()
    # many (seed, position) keys: distinct seeds and, for one seed, distinct positions
    rows = [SamplingRow(params, [1], [], seed=s, position=1) for s in range(draws // 2)]
    rows += [SamplingRow(params, [1], [], seed=123456, position=p) for p in range(draws // 2)]
    out = Sampler(vocab)(base.expand(draws, vocab).contiguous(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=vocab).double()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered token was drawn"
    assert int(kept.sum()) >= 2
    f_exp = expected[kept] / expected[kept].sum() * counts.sum()
    _, pvalue = chisquare(counts[kept].numpy(), f_exp.numpy())
    assert pvalue > 0.001, (cfg, counts.tolist(), (expected * draws).tolist())


@pytest.mark.parametrize("cfg", DIST_CONFIGS[1:] + [dict(temperature=0.5, top_k=40, top_p=0.95, min_p=0.01)])
def test_filter_masks_match_hf_warpers(cfg):
    logits = torch.randn(16, 200, generator=torch.Generator().manual_seed(3)) * 3
    ref = _hf_filtered(logits, cfg["temperature"], cfg.get("top_k", 0), cfg.get("top_p", 1.0), cfg.get("min_p", 0.0))
    n = logits.shape[0]
    top_k = torch.full((n,), cfg.get("top_k", 0) or 200)
    top_p = torch.full((n,), cfg.get("top_p", 1.0))
    min_p = torch.full((n,), cfg.get("min_p", 0.0))
    got = filter_logits(logits / cfg["temperature"], top_k, top_p, min_p)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    torch.testing.assert_close(got[~torch.isinf(got)], ref[~torch.isinf(ref)])


def test_top_p_always_keeps_one_and_min_p_relative_to_max():
    logits = torch.tensor([[10.0, 0.0, 0.0, 0.0]])
    got = filter_logits(logits, torch.tensor([4]), torch.tensor([0.01]), torch.tensor([0.0]))
    assert torch.isfinite(got).tolist() == [[True, False, False, False]]
    # probs 0.4, 0.4, 0.2: min_p 0.6 keeps tokens with p >= 0.24
    logits = torch.log(torch.tensor([[0.4, 0.4, 0.2]]))
    got = filter_logits(logits, torch.tensor([3]), torch.tensor([1.0]), torch.tensor([0.6]))
    assert torch.isfinite(got).tolist() == [[True, True, False]]


# ------------------------------------------------------------------ penalties


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    p = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    row = SamplingRow(p, [0, 1, 9999], [1, 3, 3], 0, 6)  # 9999: an id the vocab cannot draw, ignored
    got = apply_penalties(logits, [row])
    # tok0 (prompt, >0): 2/2; tok1 (prompt+output, <0): -1*2 - 0.5*1 - 0.25; tok3 (output x2): 3/2 - 0.5*2 - 0.25
    expected = torch.tensor([[1.0, -2.75, 0.5, 0.25, -2.0, 1.0]])
    torch.testing.assert_close(got, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])), "input modified in place"


def test_presence_frequency_count_output_only():
    logits = torch.zeros(1, 5)
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=1.0)
    got = apply_penalties(logits, [SamplingRow(p, [0, 0, 4], [2, 2, 2], 0, 6)])
    torch.testing.assert_close(got, torch.tensor([[0.0, 0.0, -4.0, 0.0, 0.0]]))
    # negative penalties encourage repetition
    p = SamplingParams(frequency_penalty=-0.5, presence_penalty=-1.0)
    got = apply_penalties(logits, [SamplingRow(p, [], [1], 0, 1)])
    torch.testing.assert_close(got, torch.tensor([[0.0, 1.5, 0.0, 0.0, 0.0]]))


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_matches_hf(penalty):
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 50, generator=g) * 3
    histories = [[1, 2, 3, 3, 40], [0], [49, 10, 10, 10], list(range(0, 50, 3))]
    rows = [SamplingRow(SamplingParams(repetition_penalty=penalty), h[:2], h[2:], 0, len(h)) for h in histories]
    got = apply_penalties(logits, rows)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, h in enumerate(histories):
        ref = proc(torch.tensor([h]), logits[i : i + 1].clone())
        torch.testing.assert_close(got[i : i + 1], ref)


def test_rows_without_penalties_untouched_in_mixed_batch():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(2))
    rows = [
        SamplingRow(SamplingParams(), [1, 2], [3], 0, 3),
        SamplingRow(SamplingParams(repetition_penalty=1.5), [1, 2], [3], 0, 3),
        SamplingRow(SamplingParams(), [], [], 0, 0),
    ]
    got = apply_penalties(logits, rows)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert not torch.equal(got[1], logits[1])


def test_penalty_changes_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    sampler = Sampler(3)
    assert sampler(logits, [_row(SamplingParams(temperature=0), output=[0])]).token_ids == [0]
    p = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sampler(logits, [_row(p, prompt=[], output=[0])]).token_ids == [1]


# ------------------------------------------------------------------ greedy, caps, min_tokens


def test_greedy_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 3.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
    rows = [_row(SamplingParams(temperature=0)), _row(SamplingParams(temperature=0.0, top_p=0.5))]
    assert Sampler(5)(logits, rows).token_ids == [1, 0]
    # top_k=1 is greedy at any temperature
    assert Sampler(5)(logits, [_row(SamplingParams(temperature=2.0, top_k=1, seed=3))] * 2).token_ids == [1, 0]


def test_greedy_matches_argmax_on_random_logits():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(9))
    rows = [_row(SamplingParams(temperature=0), seed=i) for i in range(32)]
    assert Sampler(300)(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_ids_beyond_vocab_size_never_drawn_and_bad_shapes_rejected():
    logits = torch.zeros(200, 10)
    logits[:, 8:] = 50.0  # padded vocab columns that must not be drawn
    rows = [_row(SamplingParams(temperature=1.0), seed=i) for i in range(200)]
    out = Sampler(8)(logits, rows).token_ids
    assert max(out) < 8 and len(set(out)) > 4
    with pytest.raises(DeepInferError, match="shape"):
        Sampler(16)(logits, rows)
    with pytest.raises(DeepInferError, match="rows"):
        Sampler(8)(logits, rows[:3])


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 10.0, 9.0, 8.0]])  # eos = 1 would win
    sampler = Sampler(4, eos_token_id=1)
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [_row(p, output=[3])]).token_ids == [3]
    assert sampler(logits, [_row(p, output=[3, 3])]).token_ids == [1]
    p_ign = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sampler(logits, [_row(p_ign, output=[])]).token_ids == [1]
    several = Sampler(4, eos_token_id=[1, 2])  # e.g. generation_config's eos list
    assert several(logits, [_row(SamplingParams(temperature=0, min_tokens=1))]).token_ids == [3]


# ------------------------------------------------------------------ logprobs


def test_logprobs_values_ranks_and_order():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 40, generator=g)
    params = [
        SamplingParams(temperature=0.5, logprobs=4, seed=1),
        SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.5),
        SamplingParams(temperature=1.0, logprobs=0),
    ]
    rows = [_row(p, seed=i, output=[7, 8]) for i, p in enumerate(params)]
    out = Sampler(40)(logits, rows)
    penalized = apply_penalties(logits, rows)
    for i, (p, lp) in enumerate(zip(params, out.logprobs)):
        ref = torch.log_softmax(penalized[i] / (p.temperature or 1.0), dim=-1)
        chosen = out.token_ids[i]
        keys = list(lp)
        assert keys[0] == chosen
        assert math.isclose(lp[chosen].logprob, ref[chosen].item(), abs_tol=1e-5)
        assert lp[chosen].rank == int((ref > ref[chosen]).sum()) + 1
        top = torch.topk(ref, p.logprobs).indices.tolist()
        assert set(keys) == set(top) | {chosen}
        for r, t in enumerate(top):
            assert lp[t].rank == r + 1 and math.isclose(lp[t].logprob, ref[t].item(), abs_tol=1e-5)
    assert out.logprobs[1][out.token_ids[1]].rank == 1  # greedy picks rank 1
    assert len(out.logprobs[2]) == 1


def test_no_logprobs_when_not_requested():
    out = Sampler(10)(torch.randn(2, 10), [_row(SamplingParams()), _row(SamplingParams(logprobs=1))])
    assert out.logprobs[0] is None and out.logprobs[1] is not None


def test_filter_rows_identical_alone_and_batched():
    vocab, n = 3000, 24
    x = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 4
    top_k = torch.tensor([vocab if i % 3 else 20 + i for i in range(n)])
    top_p = torch.tensor([0.5 + 0.02 * i for i in range(n)])
    min_p = torch.tensor([0.0 if i % 2 else 0.01 for i in range(n)])
    batched = filter_logits(x, top_k, top_p, min_p)
    for i in range(n):
        alone = filter_logits(x[i : i + 1], top_k[i : i + 1], top_p[i : i + 1], min_p[i : i + 1])
        assert torch.equal(alone[0], batched[i]), i


# ------------------------------------------------------------------ extreme values (issue 11)


@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 5e-324])
def test_tiny_temperatures_are_greedy_with_finite_logprobs(temperature):
    """Below GREEDY_TEMPERATURE a row is greedy: logits / t (which would overflow to inf) never happens."""
    from deepinfer.sampling_params import GREEDY_TEMPERATURE

    assert temperature < GREEDY_TEMPERATURE and SamplingParams(temperature=temperature).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    logits = torch.randn(16, V, generator=torch.Generator().manual_seed(4)) * 30
    tiny = [_row(SamplingParams(temperature=temperature, logprobs=5, top_p=0.3), seed=i) for i in range(16)]
    zero = [_row(SamplingParams(temperature=0.0, logprobs=5), seed=i) for i in range(16)]
    mixed = [tiny[i] if i % 2 else _row(SamplingParams(temperature=0.8, seed=i), seed=i) for i in range(16)]
    a, b, m = Sampler(V)(logits, tiny), Sampler(V)(logits, zero), Sampler(V)(logits, mixed)
    assert a.token_ids == b.token_ids == logits.argmax(-1).tolist()
    assert m.token_ids[1::2] == a.token_ids[1::2]
    for la, lb in zip(a.logprobs, b.logprobs):
        assert all(math.isfinite(x.logprob) for x in la.values())
        assert {t: x.logprob for t, x in la.items()} == {t: x.logprob for t, x in lb.items()}


def test_top_k_beyond_the_vocabulary_is_clamped():
    """top_k up to 2**31 - 1 (the validated cap) and even an unvalidated 2**63 build no out-of-range tensor."""
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(5))

    class Unchecked(SamplingParams):
        def validate(self) -> None:
            return None

    ref = Sampler(V)(logits, [_row(SamplingParams(temperature=1.0, logprobs=2), seed=i) for i in range(4)])
    for k in (V, V + 1, 2**31 - 1):
        out = Sampler(V)(logits, [_row(SamplingParams(temperature=1.0, top_k=k, logprobs=2), seed=i) for i in range(4)])
        assert out.token_ids == ref.token_ids
    out = Sampler(V)(logits, [_row(Unchecked(temperature=1.0, top_k=2**63), seed=i) for i in range(4)])
    assert out.token_ids == ref.token_ids


BOUND_PARAMS = [
    dict(temperature=1e-5), dict(temperature=100.0), dict(temperature=1e-5, top_k=2), dict(temperature=1.0, top_k=1),
    dict(temperature=1.0, top_k=2**31 - 1, top_p=1e-12), dict(temperature=0.5, top_p=1.0, min_p=1.0),
    dict(temperature=1e-5, top_p=1e-12, min_p=1.0, top_k=3),
    dict(temperature=1.0, repetition_penalty=5e-324), dict(temperature=1e-5, repetition_penalty=1e-300),
    dict(temperature=0.0, repetition_penalty=1e-45), dict(temperature=100.0, repetition_penalty=100.0),
    dict(temperature=1e-5, repetition_penalty=100.0, frequency_penalty=2.0, presence_penalty=2.0),
    dict(temperature=1e-5, repetition_penalty=1e-30, frequency_penalty=-2.0, presence_penalty=-2.0, min_p=0.9),
    dict(temperature=2.0, min_tokens=5, stop_token_ids=list(range(1, V)), top_k=5),  # only token 0 drawable
]


@pytest.mark.parametrize("scale", [1.0, 1e4])
def test_no_nan_for_any_valid_params_at_their_bounds(scale):
    """Logprobs are finite or -inf (never NaN), tokens in range and never a banned one, alone and batched."""
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(len(BOUND_PARAMS), V, generator=g) * scale
    logits[:, ::7] = float("-inf")  # the model may give -inf too (masked columns)
    logits[:, 0] = 0.5 * scale
    sampler = Sampler(V, eos_token_id=1)
    rows = [_row(SamplingParams(logprobs=20, seed=i, **kw), seed=i,
                 output=[] if "min_tokens" in kw else list(range(0, V, 3)))  # min_tokens: not reached yet
            for i, kw in enumerate(BOUND_PARAMS)]
    batched = sampler(logits, rows)
    for i, row in enumerate(rows):
        alone = sampler(logits[i : i + 1], [row])
        assert alone.token_ids == [batched.token_ids[i]]
        tok = batched.token_ids[i]
        assert 0 <= tok < V and math.isfinite(logits[i, tok])
        if row.params.min_tokens:
            assert tok == 0
        assert not any(math.isnan(x.logprob) for x in batched.logprobs[i].values())
        assert batched.logprobs[i][tok].logprob > float("-inf")


def test_tiny_repetition_penalty_stays_finite():
    from deepinfer.sample.penalties import PENALIZED_LOGIT_MAX

    logits = torch.tensor([[3.0, -2.0, 1e4, 0.0]])
    out = apply_penalties(logits, [_row(SamplingParams(repetition_penalty=5e-324), prompt=[0, 1, 2, 3])])
    assert torch.isfinite(out).all() and out[0, 0] == out[0, 2] == PENALIZED_LOGIT_MAX
    assert -1e-30 < out[0, 1] < 0 and out[0, 3] == 0.0  # a negative logit times ~0, zero stays zero
    masked = apply_penalties(torch.tensor([[float("-inf"), 1.0]]),
                             [_row(SamplingParams(repetition_penalty=1e-300), prompt=[0, 1])])
    assert masked[0, 0] == float("-inf") and masked[0, 1] == PENALIZED_LOGIT_MAX  # -inf * (penalty -> 0) is not NaN
