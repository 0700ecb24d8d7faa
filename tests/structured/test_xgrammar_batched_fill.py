"""XGrammar's batched step fill (XGrammarMatcher.fill_bitmask_batch: BatchGrammarMatcher.batch_fill_next_token_bitmask).

- the batched masks equal the per-row masks (GrammarMatcher.fill_bitmask, one call per row), for matchers of
  different grammars (JSON Schema, regex, choice, EBNF) at different depths, written to unsorted rows of a
  larger bitmask whose other rows are left as they were; filling changes no matcher's state;
- fill_grammar_mask (the sampler's host fill) goes through it and gives the per-row masks;
- a bitmask the engine cannot write into (not a contiguous int32 host tensor) is refused.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import StructuredOutputsParams
from deepinfer.sample.grammar.backend import bitmask_words
from deepinfer.sample.grammar.bitmask import fill_grammar_mask
from deepinfer.sample.grammar.matcher_state import SeqGrammar

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
SPECS = [
    (StructuredOutputsParams(json=SCHEMA, whitespace="compact"), '{"name":"ab cd","n":42}'),
    (StructuredOutputsParams(regex=r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"), "hello@mail.org"),
    (StructuredOutputsParams(choice=["yes please", "no thanks"]), "no thanks"),
    (StructuredOutputsParams(grammar='root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'), "(12+345+6)"),
]


@pytest.fixture(scope="module")
def states(compilers, embedded_tokenizer):
    """(SeqGrammar, output ids) pairs: every spec at depth 0, 1 and its last-but-one token."""
    comp = compilers("xgrammar")
    out = []
    for so, text in SPECS:
        compiled = comp.compile(so)
        ids = embedded_tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= 2, (text, ids)
        for depth in (0, 1, len(ids) - 1):
            state = SeqGrammar(comp.matcher(compiled))
            state.sync(ids[:depth])
            assert state.error is None
            out.append((state, ids[:depth]))
    return out


def test_batched_fill_equals_per_row_fill(states, facts):
    words = bitmask_words(facts.vocab_size)
    matchers = [s.matcher for s, _ in states]
    cls = type(matchers[0])
    assert "fill_bitmask_batch" in vars(cls)  # the engine's own batched fill, not the interface's row loop
    per_row = torch.zeros(len(matchers), words, dtype=torch.int32)
    for j, m in enumerate(matchers):
        m.fill_bitmask(per_row[j])
    assert len({tuple(r.tolist()) for r in per_row}) >= len(SPECS) * 2  # masks that differ: the check can fail
    assert not bool((per_row == -1).all(dim=1).any()) and bool(per_row.any(dim=1).all())

    n = len(matchers)
    targets = [(7 * j + 3) % (n + 4) for j in range(n)]  # distinct, unsorted rows of a larger mask
    assert len(set(targets)) == n
    batched = torch.full((n + 4, words), 0x5A5A5A5A, dtype=torch.int32)
    cls.fill_bitmask_batch([(m, t) for m, t in zip(matchers, targets)], batched)
    assert torch.equal(batched[targets], per_row)
    untouched = [r for r in range(n + 4) if r not in targets]
    assert bool((batched[untouched] == 0x5A5A5A5A).all())

    again = torch.zeros_like(per_row)  # the fill is read-only: the states are where they were
    for j, m in enumerate(matchers):
        m.fill_bitmask(again[j])
    assert torch.equal(again, per_row)


def test_fill_grammar_mask_uses_it(states, facts):
    mask, failed = fill_grammar_mask([(j, s, ids, False) for j, (s, ids) in enumerate(states)], facts,
                                     facts.forbidden_mask())
    assert not failed
    expect = torch.zeros(len(states), bitmask_words(facts.vocab_size), dtype=torch.int32)
    for j, (s, _) in enumerate(states):
        s.matcher.fill_bitmask(expect[j])
    assert torch.equal(mask.bitmask, expect & ~facts.forbidden_mask())


def test_a_bitmask_it_cannot_write_is_refused(states, facts):
    matcher = states[0][0].matcher
    words = bitmask_words(facts.vocab_size)
    with pytest.raises(ValueError, match="contiguous int32 host tensor"):
        type(matcher).fill_bitmask_batch([(matcher, 0)], torch.zeros(words, 2, dtype=torch.int32).t())
    with pytest.raises(ValueError, match="contiguous int32 host tensor"):
        type(matcher).fill_bitmask_batch([(matcher, 0)], torch.zeros(2, words, dtype=torch.int64))
