"""The host fill of a batch's grammar bitmask (the device applies it: Backend.apply_token_bitmask).

One int32 row per constrained row of the batch, in the layout of backend.py. Rows are filled by
the engine's matchers (llguidance / XGrammar compute a mask in tens of microseconds for typical
JSON schemas: benchmarks/structured_output.py), then ids no grammar may allow (beyond the
tokenizer, special tokens other than EOS) are cleared. A row whose state is in error or whose
mask allows nothing cannot be sampled: it is reported, never sampled unconstrained.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.sample.grammar.backend import TokenizerFacts, bitmask_words
from deepinfer.sample.grammar.matcher_state import SeqGrammar


@dataclass
class GrammarMask:
    """rows: indices (into the sampler's rows) that are constrained; bitmask: int32 [len(rows), words] on the host."""

    rows: list[int]
    bitmask: torch.Tensor

    def select(self, keep: list[int]) -> GrammarMask | None:
        """The mask for the sub-batch made of rows `keep` (renumbered 0..len(keep)-1), None if none is constrained."""
        pos = {r: j for j, r in enumerate(self.rows)}
        pairs = [(i, pos[r]) for i, r in enumerate(keep) if r in pos]
        if not pairs:
            return None
        return GrammarMask([i for i, _ in pairs], self.bitmask[[j for _, j in pairs]])


def fill_grammar_mask(states: list[tuple[int, SeqGrammar, list[int], bool]], facts: TokenizerFacts,
                      forbidden: torch.Tensor) -> tuple[GrammarMask | None, dict[int, str]]:
    """states: (row, its grammar state, its output token ids, whether its token will be dropped).

    Returns the mask and {row: why it cannot be sampled}. A row whose sequence already finished
    (its token is dropped when the step resolves) gets an all-allowed row: nothing it draws is kept."""
    if not states:
        return None, {}
    words = bitmask_words(facts.vocab_size)
    bitmask = torch.full((len(states), words), -1, dtype=torch.int32)
    failed: dict[int, str] = {}
    by_engine: dict[type, list] = {}  # matcher class -> [(matcher, row of bitmask)]: one batched fill per engine
    live = []
    for j, (row, state, output_ids, dropped) in enumerate(states):
        if dropped:
            continue
        state.sync(output_ids)
        error = state.error or state.matcher.error()
        if error is not None:
            failed[row] = f"structured output: {error}"
            continue
        by_engine.setdefault(type(state.matcher), []).append((state.matcher, j))
        live.append((j, row, state))
    for cls, items in by_engine.items():
        cls.fill_bitmask_batch(items, bitmask)
    if live:  # ids no grammar may allow, cleared in the live rows (a dropped row stays all-allowed)
        idx = torch.tensor([j for j, _, _ in live])
        bitmask[idx] = bitmask[idx] & ~forbidden
    empty = ~bitmask.any(dim=1)
    for j, row, state in live:
        error = state.matcher.error()
        if error is None and bool(empty[j]):
            error = "the grammar allows no next token (it has ended and EOS is not allowed)"
        if error is not None:
            failed[row] = f"structured output: {error}"
    return GrammarMask([s[0] for s in states], bitmask), failed
