"""Prompt-lookup drafting for models without MTP: the longest recent n-gram that occurred before in the
sequence proposes the tokens that followed it then.

Deterministic (a one-hot draft distribution), so acceptance uses rejection.py's q=None rule. The
confidence of a proposal is the fraction of earlier occurrences of the matched n-gram that were
followed by the same token (a function of the context only: non-anticipating).
"""

from __future__ import annotations

from dataclasses import dataclass


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
        """Up to k draft tokens continuing `tokens` (prompt + output so far)."""
        if k <= 0 or len(tokens) < 2:
            return NgramProposal([], [])
        hist = tokens[-self.lookback :]
        n_hist = len(hist)
        for n in range(min(self.max_ngram, n_hist - 1), self.min_ngram - 1, -1):
            suffix = hist[n_hist - n :]
            starts = [i for i in range(n_hist - n - 1, -1, -1) if hist[i : i + n] == suffix]
            if not starts:
                continue
            first = starts[0] + n  # the most recent earlier occurrence's continuation
            out = hist[first : first + k]
            # agreement of all occurrences on each proposed token
            conf = []
            for j, tok in enumerate(out):
                follow = [hist[s + n + j] for s in starts if s + n + j < n_hist]
                conf.append(sum(1 for t in follow if t == tok) / max(1, len(follow)))
            return NgramProposal(list(out), conf)
        return NgramProposal([], [])
