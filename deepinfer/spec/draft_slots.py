"""Draft slots of a scheduled step: how many drafted tokens each decoding sequence verifies, and the KV
to hold them.

After the scheduler has placed every running sequence (one token per decode, as without speculation),
each decode that holds a draft for its current length gets k_i more query tokens, where k_i is
- the static k (EngineConfig.num_speculative_tokens), or the confidence scheduler's admission
  (spec/slot_policy.py: SlotPolicy.counts, from calibrated survival estimates of the drafts' confidences) when
  adaptive;
- capped so the accepted run cannot pass max_tokens or max_model_len (1 + k_i tokens may be emitted);
- within the step's leftover token budget, and only where the KV cache has room without preempting
  anyone (speculation never evicts a sequence: a draft that does not fit is verified shorter or not at all).

The choice reads confidences and calibration counts only, never the verification draw it decides
(non-anticipating; for greedy MTP drafts the drafted token itself may be read, docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.kv.manager import KVCacheManager
from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import ScheduledSeq, SchedulerOutput

if TYPE_CHECKING:
    from deepinfer.spec.slot_policy import SlotPolicy


@dataclass
class HeldDraft:
    """A sequence's draft, valid while the sequence still has num_tokens tokens."""

    seq: Sequence
    num_tokens: int
    tokens: list[int]
    confidence: list[float]


@dataclass
class DraftBook:
    """The drafts waiting for the next step, by sequence id."""

    drafts: dict[str, HeldDraft] = field(default_factory=dict)

    def put(self, seq: Sequence, tokens: list[int], confidence: list[float]) -> None:
        if tokens and not seq.finished:
            self.drafts[seq.seq_id] = HeldDraft(seq, seq.num_tokens, tokens, confidence)
        else:
            self.drafts.pop(seq.seq_id, None)

    def take(self, seq: Sequence) -> HeldDraft | None:
        """The draft for the sequence's current length, if any (a preempted or stale draft is dropped)."""
        d = self.drafts.pop(seq.seq_id, None)
        if d is None or d.seq is not seq or d.num_tokens != seq.num_tokens or seq.finished:
            return None
        return d

    def discard(self, seq: Sequence) -> None:
        self.drafts.pop(seq.seq_id, None)

    def prune(self) -> None:
        """Forget drafts of finished (aborted) sequences."""
        for sid in [s for s, d in self.drafts.items() if d.seq.finished]:
            del self.drafts[sid]


def length_cap(seq: Sequence, max_model_len: int) -> int:
    """Most drafts the sequence may verify: 1 + k emitted tokens must fit max_tokens and max_model_len."""
    cap = max_model_len - seq.num_tokens - 1
    mt = seq.params.max_tokens
    if mt is not None:
        cap = min(cap, mt - len(seq.output_token_ids) - 1)
    return max(cap, 0)


def cover_tokens(kv: KVCacheManager, seq: Sequence, n: int) -> bool:
    """Cover the sequence's next n tokens (past its num_computed_tokens) without preempting anyone."""
    if kv.try_extend(seq, n):
        return True
    if kv.can_allocate(seq, n):
        kv.allocate(seq, n)
        return True
    return False


def add_draft_slots(sched: SchedulerOutput, book: DraftBook, kv: KVCacheManager, policy: SlotPolicy,
                    budget: int, clip: Callable[[Sequence, list[int]], int] | None = None) -> dict[int, list[float]]:
    """Give the step's decodes their draft slots (in place: ScheduledSeq.draft, num_tokens); returns the
    confidences of the verified drafts by index into sched.scheduled (the calibrator's inputs).

    clip(seq, draft): how many leading draft tokens may be verified at all (structured output: the
    grammar-allowed prefix, sample/grammar/draft_mask.py), applied before the policy counts slots."""
    for seq in (s for s in sched.preempted):
        book.discard(seq)
    cands: list[tuple[int, ScheduledSeq, HeldDraft, int]] = []
    for index, item in enumerate(sched.scheduled):
        if not item.samples or item.num_tokens != 1:
            book.discard(item.seq)  # a prompt chunk or a recompute: any old draft is stale
            continue
        held = book.take(item.seq)
        if held is None:
            continue
        if clip is not None:
            n = clip(item.seq, held.tokens)
            if n == 0:
                continue
            if n < len(held.tokens):  # (the usual n = all: no copies)
                held.tokens, held.confidence = held.tokens[:n], held.confidence[:n]
        cands.append((index, item, held, length_cap(item.seq, policy.max_model_len)))
    confidence: dict[int, list[float]] = {}
    if not cands:
        return confidence
    used = sum(it.num_tokens for it in sched.scheduled)
    base_yield = sum(1 for it in sched.scheduled if it.samples)
    counts = policy.counts([h for _, _, h, _ in cands], [c for _, _, _, c in cands], used, base_yield)
    left = budget - used
    for (index, item, held, _), k in zip(cands, counts):
        k = min(k, max(left, 0))
        while k > 0 and not cover_tokens(kv, item.seq, 1 + k):
            k -= 1
        if k > 0:
            whole = k == len(held.tokens)  # the held lists are the step's own (the book gave them up): no copies
            item.draft = held.tokens if whole else held.tokens[:k]
            item.num_tokens = 1 + k
            confidence[index] = held.confidence if whole else held.confidence[:k]
            left -= k
    return confidence
