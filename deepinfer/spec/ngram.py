"""Prompt-lookup drafting for models without MTP: the longest recent n-gram that occurred before in the
sequence proposes the tokens that followed it then.

Deterministic (a one-hot draft distribution), so acceptance uses rejection.py's q=None rule. The
confidence of a proposal is the fraction of earlier occurrences of the matched n-gram that were
followed by the same token (a function of the context only: non-anticipating).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class NgramProposal:
    tokens: list[int]
    confidence: list[float]


@dataclass
class NgramDrafter:
    """max_ngram down to min_ngram: the suffix lengths tried, longest first; lookback: tokens searched."""

    max_ngram: int = 4
    min_ngram: int = 1
    lookback: int = 2048

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"NgramDrafter needs 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")

    def propose(self, tokens: list[int], k: int) -> NgramProposal:
        """Up to k draft tokens continuing `tokens` (prompt + output so far).

        Vectorised (numpy: the positions of the suffix's first token, narrowed token by token). A pure-Python scan
        of the 2048-token lookback for every n-gram size took ~1.2 ms per sequence and step (~77 ms a step at 64
        sequences); this takes ~0.06 ms and proposes the same tokens with the same confidences
        (tests/spec/test_spec_parts.py)."""
        if k <= 0 or len(tokens) < 2:
            return NgramProposal([], [])
        hist = np.asarray(tokens[-self.lookback :], dtype=np.int64)
        n_hist = len(hist)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = hist[n_hist - n :]
            # earlier occurrences start at 0 .. n_hist - n - 1 (the suffix itself excluded): the positions of its
            # first token, narrowed by each next one
            starts = np.flatnonzero(hist[: n_hist - n] == suffix[0])
            for t in range(1, n):
                starts = starts[hist[starts + t] == suffix[t]]
            starts = starts[::-1]  # the most recent first
            if starts.size == 0:
                continue
            first = int(starts[0]) + n  # the most recent earlier occurrence's continuation
            out = hist[first : first + k]
            # agreement of all occurrences on each proposed token
            conf = []
            for j, tok in enumerate(out.tolist()):
                idx = starts + n + j
                follow = hist[idx[idx < n_hist]]
                conf.append(int((follow == tok).sum()) / max(1, int(follow.size)))
            return NgramProposal(out.tolist(), conf)
        return NgramProposal([], [])
