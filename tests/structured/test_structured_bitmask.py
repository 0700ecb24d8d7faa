"""The grammar bitmask op and its use in the sampler.

- native op == a brute-force reading of the bits (padding beyond the mask's words is forbidden);
- the Triton kernel (nvidia backend, TRITON_INTERPRET=1 here) == the native op, bit for bit;
- the sampler: a masked greedy row picks the best ALLOWED token, a masked sampled row never draws a
  forbidden one, logprobs are those of the masked distribution, unconstrained rows are untouched;
- fill_grammar_mask never allows padding ids, and a finished row's mask does not fail the step.
"""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer import SamplingParams
from deepinfer.backend.native.grammar import apply_token_bitmask
from deepinfer.sample.grammar.backend import pack_bits, unpack_bits
from deepinfer.sample.grammar.bitmask import GrammarMask
from deepinfer.sample.sampler import Sampler, SamplingRow


def random_mask(rows: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return pack_bits(torch.rand(rows, words * 32, generator=g) < 0.3)


@pytest.mark.parametrize("vocab,words", [(70, 3), (70, 2), (100, 4)])
def test_native_op_matches_the_bits(vocab, words):
    logits = torch.randn(4, vocab)
    mask = random_mask(2, words, vocab)
    rows = torch.tensor([3, 1])
    out = apply_token_bitmask(logits.clone(), mask, rows)
    allowed = torch.zeros(2, vocab, dtype=torch.bool)
    allowed[:, : min(vocab, words * 32)] = unpack_bits(mask, min(vocab, words * 32))
    for j, r in enumerate(rows.tolist()):
        expect = torch.where(allowed[j], logits[r], torch.tensor(float("-inf")))
        assert torch.equal(out[r], expect)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])  # unconstrained rows untouched


@pytest.mark.parametrize("vocab,words,with_rows", [(70, 3, True), (70, 2, False), (2049, 65, True)])
def test_triton_kernel_matches_native(vocab, words, with_rows):
    pytest.importorskip("triton")
    from deepinfer.backends.nvidia.grammar_bitmask import apply_token_bitmask as triton_apply

    logits = torch.randn(5 if with_rows else 3, vocab)
    mask = random_mask(3, words, vocab + words)
    rows = torch.tensor([4, 0, 2]) if with_rows else None
    assert torch.equal(triton_apply(logits.clone(), mask, rows), apply_token_bitmask(logits.clone(), mask, rows))


def test_sampler_applies_mask_and_masked_logprobs():
    vocab = 40
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    allowed = torch.zeros(2, 64, dtype=torch.bool)
    allowed[0, [3, 7, 11]] = True
    allowed[1, [5, 6]] = True
    grammar = GrammarMask([0, 2], pack_bits(allowed))
    sampler = Sampler(vocab, eos_token_id=1)
    greedy = SamplingParams(temperature=0, logprobs=3)
    rows = [SamplingRow(greedy, [0], [], seed=1, position=1),
            SamplingRow(greedy, [0], [], seed=1, position=1),
            SamplingRow(SamplingParams(temperature=1.0, seed=5, logprobs=2), [0], [], seed=5, position=1)]
    out = sampler(logits, rows, grammar)
    assert out.token_ids[0] == max([3, 7, 11], key=lambda t: logits[0, t].item())
    assert out.token_ids[1] == int(logits[1].argmax())
    assert out.token_ids[2] in (5, 6)
    lp0 = out.logprobs[0]
    total = sum(math.exp(v.logprob) for k, v in lp0.items() if k in (3, 7, 11))
    assert total == pytest.approx(1.0, abs=1e-5)  # all the mass is on the allowed tokens
    for seed in range(20):  # sampled rows: never a forbidden token
        rows[2] = SamplingRow(SamplingParams(temperature=2.0, seed=seed), [0], [], seed=seed, position=3)
        assert sampler(logits, rows, grammar).token_ids[2] in (5, 6)


def test_grammar_mask_select():
    mask = GrammarMask([1, 3], pack_bits(torch.ones(2, 32, dtype=torch.bool)))
    sub = mask.select([0, 3])
    assert sub.rows == [1] and sub.bitmask.shape == (1, 1)
    assert mask.select([0, 2]) is None


def test_fill_masks_padding_and_finished_rows(facts, compilers, embedded_tokenizer):
    from deepinfer import StructuredOutputsParams
    from deepinfer.sample.grammar.bitmask import fill_grammar_mask
    from deepinfer.sample.grammar.matcher_state import SeqGrammar

    compiler = compilers("llguidance")
    compiled = compiler.compile(StructuredOutputsParams(regex="ab"))
    done = SeqGrammar(compiler.matcher(compiled))
    live = SeqGrammar(compiler.matcher(compiled))
    eos = facts.eos_token_ids[0]
    mask, failed = fill_grammar_mask([(0, done, [], True), (1, live, [], False)], facts, facts.forbidden_mask())
    assert not failed
    allowed = unpack_bits(mask.bitmask, facts.vocab_size)
    assert allowed[0].all() and not allowed[1, facts.tokenizer_vocab_size:].any() and not allowed[1, eos]
    # a state fed a token its grammar refuses fails its row (never sampled unconstrained)
    bad = SeqGrammar(compiler.matcher(compiled))
    _, failed = fill_grammar_mask([(0, bad, [eos, eos], False)], facts, facts.forbidden_mask())
    assert 0 in failed and "not allowed" in failed[0]
    # rollback: the lazily fed state follows the sequence's tokens down again
    tok_a = embedded_tokenizer.encode("a", add_special_tokens=False)
    state = SeqGrammar(compiler.matcher(compiled))
    state.sync(tok_a)
    assert state.num_accepted == len(tok_a)
    state.sync([])
    assert state.num_accepted == 0 and state.error is None
