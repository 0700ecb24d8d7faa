"""A sequence's grammar state: its matcher, fed with the sequence's output tokens lazily.

Why lazily: the matcher must have seen exactly the tokens the sequence holds before its next
mask is filled, whatever happened in between: a token appended by output processing (sync or
async scheduling alike), a token drawn for a sequence that finished meanwhile and dropped
(never appended, so never fed), preemption by recompute (the output tokens stay, so the matcher
stays too: nothing to replay), or tokens taken back (a stop landing inside a speculative run:
the matcher is rolled back to the sequence's length; rejected drafts were never committed,
draft_mask.py). `sync` compares the matcher's count with the sequence's output and feeds or
rolls back the difference, so there is one rule instead of a hook per event.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.sample.grammar.backend import GrammarMatcher


@dataclass(eq=False)
class SeqGrammar:
    """matcher: the engine's matcher; num_accepted: how many output tokens it has consumed."""

    matcher: GrammarMatcher
    num_accepted: int = 0
    error: str | None = None

    def sync(self, output_token_ids: list[int]) -> None:
        """Bring the matcher to output_token_ids (feed new tokens, roll back removed ones).

        A token the grammar refuses (it cannot happen under the mask; it would mean a bug or a token
        forced in from outside) puts the state in error: `error` says which, and the caller fails
        the request rather than sampling it unconstrained."""
        if self.error is not None:
            return
        n = len(output_token_ids)
        if n < self.num_accepted:
            self.matcher.rollback(self.num_accepted - n)
            self.num_accepted = n
        while self.num_accepted < n:
            token = output_token_ids[self.num_accepted]
            if not self.matcher.accept(token):
                self.error = (f"output token {token} (position {self.num_accepted}) is not allowed by the grammar: "
                              f"{self.matcher.error() or 'refused'}")
                return
            self.num_accepted += 1

    def rollback(self, num_tokens: int) -> None:
        """Take back the last num_tokens accepted tokens (speculative decoding's rejected drafts)."""
        num_tokens = min(num_tokens, self.num_accepted)
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens
