"""Grammar masks under speculative decoding: a draft cut at its first forbidden token, then one mask per
verified position, each at the grammar state after the drafted tokens before it.

Why this is lossless: the target's token at verified position j is drawn under the mask of the state after
output + draft[:j]. If draft[:j] is accepted, that is exactly the state the sequence is in there without
speculation, so the masked distribution (and, at T = 0, its argmax; at T > 0, the draw keyed by (seed,
position)) is the one speculation off gives. A drafted token the grammar forbids can never equal a masked
target token, so it is rejected for sure and the positions after it would be verified for nothing: the
draft is cut there before verification (`clip_draft`); a drafter proposing grammar-invalid tokens costs
acceptance only, never validity.

The matcher moves tentatively through the draft inside the fill (llguidance's LLExecutor does it in Rust
and rolls back; XGrammar by accept + rollback) and is back at the committed state afterwards. The tokens
the verification emits (the accepted drafts, then the target's token) are committed by `SeqGrammar.sync`
when output processing has appended them, like any sampled token; the rejected rest was never committed.

EOS in a draft: allowed only where the grammar is complete (valid_prefix counts it then); the draft is cut
after it (nothing follows EOS), and the row after it is all-allowed: it is drawn only if EOS is accepted,
and then the sequence finishes at EOS and that token is dropped (the convention of bitmask.py's dropped rows).
"""

from __future__ import annotations

import torch

from deepinfer.sample.grammar.backend import TokenizerFacts, bitmask_words
from deepinfer.sample.grammar.bitmask import GrammarMask
from deepinfer.sample.grammar.matcher_state import SeqGrammar


def clip_draft(state: SeqGrammar, output_token_ids: list[int], draft: list[int], eos_token_ids) -> int:
    """How many leading tokens of `draft` to verify: the grammar-allowed prefix, cut after an EOS.

    Brings the matcher to the sequence's output first (SeqGrammar.sync); a state in error verifies nothing
    (the mask fill reports the error and the request fails there)."""
    if not draft:
        return 0
    state.sync(output_token_ids)
    if state.error is not None or state.matcher.error() is not None:
        return 0
    n = min(state.matcher.valid_prefix(draft), len(draft))
    eos = set(eos_token_ids)
    for j in range(n):
        if draft[j] in eos:
            return j + 1
    return n


def fill_draft_grammar_mask(states: list[tuple[int, SeqGrammar, list[int], list[int]]], facts: TokenizerFacts,
                            forbidden: torch.Tensor) -> tuple[GrammarMask | None, dict[int, str]]:
    """states: (first row, grammar state, output token ids, draft) per constrained sequence; the sequence owns
    rows first .. first + len(draft) of the sampler's rows (its verified positions). Drafts must have been
    cut by `clip_draft`.

    Returns the mask over those rows (in order) and {first row: why the sequence cannot be sampled}; a failed
    sequence's rows are still in the mask (all-allowed) so the caller can leave them out of the draw."""
    if not states:
        return None, {}
    eos = set(facts.eos_token_ids)
    words = bitmask_words(facts.vocab_size)
    total = sum(len(d) + 1 for _, _, _, d in states)
    # nothing allowed until filled: a row an engine failed to write fails its sequence (fail closed)
    bitmask = torch.zeros((total, words), dtype=torch.int32)
    rows: list[int] = []
    failed: dict[int, str] = {}
    by_engine: dict[type, list] = {}  # matcher class -> [(matcher, first row of bitmask, draft)]
    live: list[tuple[int, int, int, SeqGrammar]] = []  # (first sampler row, first bitmask row, rows filled, state)
    after_eos: list[int] = []  # bitmask rows after a drafted EOS: all-allowed
    j = 0
    for first, state, output_ids, draft in states:
        rows.extend(range(first, first + len(draft) + 1))
        state.sync(output_ids)
        error = state.error or state.matcher.error()
        if error is not None:
            failed[first] = f"structured output: {error}"
            bitmask[j : j + len(draft) + 1] = -1
            j += len(draft) + 1
            continue
        walk = list(draft)
        if walk and walk[-1] in eos:
            walk.pop()
            after_eos.append(j + len(draft))
        if any(t in eos for t in walk):
            raise ValueError(f"draft {draft} holds EOS before its end: cut it with clip_draft first")
        by_engine.setdefault(type(state.matcher), []).append((state.matcher, j, walk))
        live.append((first, j, len(walk) + 1, state))
        j += len(draft) + 1
    for cls, items in by_engine.items():
        cls.fill_bitmask_draft_batch(items, bitmask)
    for first, b, n, state in live:
        bitmask[b : b + n] &= ~forbidden
        error = state.matcher.error()
        if error is None and not bool(bitmask[b : b + n].any(dim=1).all()):
            error = "the grammar allows no next token (it has ended and EOS is not allowed)"
        if error is not None:
            failed[first] = f"structured output: {error}"
            bitmask[b : b + n] = -1
    if after_eos:
        bitmask[after_eos] = -1
    return GrammarMask(rows, bitmask), failed
