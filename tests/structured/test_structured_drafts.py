"""Grammar masks for speculative decoding (sample/grammar/draft_mask.py), on both engines.

- the mask of every drafted position equals the mask a fresh matcher gives after the same tokens (the
  tentative walk), and the matcher is back at its committed state afterwards;
- a draft is cut at its first grammar-forbidden token, and after an EOS the grammar allows; an EOS the
  grammar does not allow yet is forbidden like any token;
- after a partial acceptance (some drafts accepted, then a different token) the matcher's state equals
  a fresh matcher fed the sequence's output; a stop landing earlier rolls it back further;
- a state in error fails its sequence (reported, its rows all-allowed so the caller can drop them);
- the interface's default walk (for a third engine) equals both engines' batched ones.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import StructuredOutputsParams
from deepinfer.sample.grammar.backend import GrammarMatcher, bitmask_words
from deepinfer.sample.grammar.bitmask import fill_grammar_mask
from deepinfer.sample.grammar.draft_mask import clip_draft, fill_draft_grammar_mask
from deepinfer.sample.grammar.matcher_state import SeqGrammar

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["name", "n"], "additionalProperties": False}
INSTANCE = '{"name":"ab cd","n":42}'
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
ADDRESS = "hello@mail.org"
ENGINES = ["llguidance", "xgrammar"]


def _case(kind: str):
    if kind == "json":
        return StructuredOutputsParams(json=SCHEMA, whitespace="compact"), INSTANCE
    return StructuredOutputsParams(regex=REGEX), ADDRESS


def _setup(compilers, embedded_tokenizer, engine, kind):
    so, text = _case(kind)
    comp = compilers(engine)
    compiled = comp.compile(so)
    ids = embedded_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) >= 5, ids  # enough tokens to draft several
    return comp, compiled, ids


def _sequential_mask(comp, compiled, facts, tokens: list[int]) -> torch.Tensor:
    """The mask without speculation: a fresh matcher fed `tokens`, filled by the one-row path."""
    state = SeqGrammar(comp.matcher(compiled))
    mask, failed = fill_grammar_mask([(0, state, tokens, False)], facts, facts.forbidden_mask())
    assert not failed
    return mask.bitmask[0]


@pytest.mark.parametrize("kind", ["json", "regex"])
@pytest.mark.parametrize("engine", ENGINES)
def test_draft_masks_equal_sequential_masks_and_state_is_kept(engine, kind, compilers, embedded_tokenizer, facts):
    comp, compiled, ids = _setup(compilers, embedded_tokenizer, engine, kind)
    forbidden = facts.forbidden_mask()
    states, want = [], []
    # three sequences in one batched fill: different prefixes, drafts of 3, 0 and the whole rest + EOS
    cuts = [(1, ids[1:4]), (2, []), (0, ids + [facts.eos_token_ids[0]])]
    row = 0
    for start, draft in cuts:
        st = SeqGrammar(comp.matcher(compiled))
        st.sync(ids[:start])
        assert clip_draft(st, ids[:start], draft, facts.eos_token_ids) == len(draft)
        states.append((row, st, ids[:start], draft))
        walk = draft[:-1] if draft and draft[-1] in facts.eos_token_ids else draft
        want += [_sequential_mask(comp, compiled, facts, ids[:start] + walk[:j]) for j in range(len(walk) + 1)]
        if walk is not draft:
            want.append(None)  # after EOS: all-allowed
        row += len(draft) + 1
    mask, failed = fill_draft_grammar_mask(states, facts, forbidden)
    assert not failed
    assert mask.rows == list(range(row)) and mask.bitmask.shape == (row, bitmask_words(facts.vocab_size))
    for j, w in enumerate(want):
        if w is None:
            assert bool((mask.bitmask[j] == -1).all()), j
        else:
            assert torch.equal(mask.bitmask[j], w), j
    # the tentative walk left every matcher where it was: its next mask is the committed state's
    for (_, st, out, _), start in zip(states, [c[0] for c in cuts]):
        assert st.num_accepted == start
        again, _ = fill_grammar_mask([(0, st, out, False)], facts, forbidden)
        assert torch.equal(again.bitmask[0], _sequential_mask(comp, compiled, facts, out))


@pytest.mark.parametrize("engine", ENGINES)
def test_draft_is_cut_at_the_first_forbidden_token_and_after_eos(engine, compilers, embedded_tokenizer, facts):
    comp, compiled, ids = _setup(compilers, embedded_tokenizer, engine, "regex")
    eos = facts.eos_token_ids[0]
    bad = embedded_tokenizer.encode("{", add_special_tokens=False)[0]  # no '{' in an e-mail address
    st = SeqGrammar(comp.matcher(compiled))
    assert clip_draft(st, [], [bad] + ids, facts.eos_token_ids) == 0
    assert clip_draft(st, ids[:1], ids[1:3] + [bad] + ids[3:], facts.eos_token_ids) == 2
    assert clip_draft(st, ids[:1], ids[1:3] + [eos] + ids[3:], facts.eos_token_ids) == 2  # EOS too early
    assert clip_draft(st, ids[:2], ids[2:] + [eos, ids[0], ids[1]], facts.eos_token_ids) == len(ids) - 2 + 1
    assert clip_draft(st, ids[:2], ids[2:], facts.eos_token_ids) == len(ids) - 2
    assert st.num_accepted == 2 and st.error is None  # clipping synced the state and changed nothing else
    # the cut draft's masks: the forbidden token is never the subject of a mask row
    n = clip_draft(st, ids[:1], ids[1:3] + [bad] + ids[3:], facts.eos_token_ids)
    mask, failed = fill_draft_grammar_mask([(5, st, ids[:1], (ids[1:3] + [bad])[:n])], facts, facts.forbidden_mask())
    assert not failed and mask.rows == [5, 6, 7]
    allowed = ((mask.bitmask[:, bad // 32] >> (bad % 32)) & 1).tolist()
    assert allowed == [0, 0, 0]  # the token the drafter proposed can never be drawn at any of these positions


@pytest.mark.parametrize("kind", ["json", "regex"])
@pytest.mark.parametrize("engine", ENGINES)
def test_state_after_partial_acceptance_equals_a_fresh_matcher(engine, kind, compilers, embedded_tokenizer, facts):
    comp, compiled, ids = _setup(compilers, embedded_tokenizer, engine, kind)
    forbidden = facts.forbidden_mask()
    st = SeqGrammar(comp.matcher(compiled))
    start = 5 if kind == "json" else 1  # the run diverges inside the string / the domain: many tokens allowed
    out = ids[:start]
    draft = ids[start : start + 4]
    n = clip_draft(st, out, draft, facts.eos_token_ids)
    assert n == len(draft)
    mask, _ = fill_draft_grammar_mask([(0, st, out, draft)], facts, forbidden)
    # verification: drafts 0 and 1 accepted, then the target's token differs from draft 2 (any other
    # token the mask of position 2 allows: what a masked draw there can give)
    allowed2 = [t for t in range(facts.tokenizer_vocab_size)
                if (int(mask.bitmask[2, t // 32]) >> (t % 32)) & 1 and t != draft[2] and t not in facts.eos_token_ids]
    assert allowed2, "the grammar allows another token at position 2"
    emitted = out + draft[:2] + [allowed2[0]]
    again, failed = fill_grammar_mask([(0, st, emitted, False)], facts, forbidden)
    assert not failed and st.num_accepted == len(emitted)
    assert torch.equal(again.bitmask[0], _sequential_mask(comp, compiled, facts, emitted))
    # a stop string / max_tokens landing inside the run keeps fewer tokens: the state follows them back
    kept = emitted[: start + 1]
    again, failed = fill_grammar_mask([(0, st, kept, False)], facts, forbidden)
    assert not failed and st.num_accepted == start + 1
    assert torch.equal(again.bitmask[0], _sequential_mask(comp, compiled, facts, kept))


def test_a_state_in_error_fails_its_sequence_only(compilers, embedded_tokenizer, facts):
    comp, compiled, ids = _setup(compilers, embedded_tokenizer, "llguidance", "regex")
    bad = embedded_tokenizer.encode("{", add_special_tokens=False)[0]
    broken, fine = SeqGrammar(comp.matcher(compiled)), SeqGrammar(comp.matcher(compiled))
    assert clip_draft(broken, [bad], ids[:2], facts.eos_token_ids) == 0  # an output token the grammar refuses
    assert broken.error is not None
    mask, failed = fill_draft_grammar_mask([(0, broken, [bad], []), (1, fine, ids[:1], ids[1:3])], facts,
                                           facts.forbidden_mask())
    assert list(failed) == [0] and "not allowed by the grammar" in failed[0]
    assert bool((mask.bitmask[0] == -1).all())  # all-allowed: the caller leaves it out of the draw
    assert mask.rows == [0, 1, 2, 3]


@pytest.mark.parametrize("engine", ENGINES)
def test_default_walk_equals_the_engines_batched_walk(engine, compilers, embedded_tokenizer, facts):
    comp, compiled, ids = _setup(compilers, embedded_tokenizer, engine, "json")
    words = bitmask_words(facts.vocab_size)
    items_a = [(comp.matcher(compiled), 0, ids[:4]), (comp.matcher(compiled), 5, [])]
    items_b = [(comp.matcher(compiled), 0, ids[:4]), (comp.matcher(compiled), 5, [])]
    a = torch.zeros(6, words, dtype=torch.int32)
    b = torch.zeros(6, words, dtype=torch.int32)
    type(items_a[0][0]).fill_bitmask_draft_batch(items_a, a)
    GrammarMatcher.fill_bitmask_draft_batch.__func__(type(items_b[0][0]), items_b, b)  # the interface's default
    assert torch.equal(a, b) and bool(a.any(dim=1).all())
    with pytest.raises(ValueError, match="valid_prefix"):  # a draft that was not cut is refused, state kept
        GrammarMatcher.fill_bitmask_draft_batch.__func__(type(items_b[0][0]), [(items_b[0][0], 0, [ids[0], 0])], b)
    assert items_b[0][0].valid_prefix(ids[:4]) == 4
