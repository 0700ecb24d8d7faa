"""Draft slots of a scheduled step: how many drafted tokens each decoding sequence verifies, and the KV
to hold them.

After the scheduler has placed every running sequence (one token per decode, as without speculation),
each decode that holds a draft for its current length gets k_i more query tokens, where k_i is
- the static k (EngineConfig.num_speculative_tokens), or the confidence scheduler's admission
  (spec/scheduler.py: `admit`, from calibrated survival estimates of the drafts' confidences) when
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

import torch

from deepinfer.kv.manager import KVCacheManager
from deepinfer.sched.request import Sequence
from deepinfer.sched.scheduler import ScheduledSeq, SchedulerOutput
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.scheduler import StepCostTable, admit

if TYPE_CHECKING:
    from deepinfer.spec.draft_cost import DraftCostTable


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


def _extend(kv: KVCacheManager, seq: Sequence, n: int) -> bool:
    """Cover the sequence's next n tokens without preempting anyone."""
    if kv.try_extend(seq, n):
        return True
    if kv.can_allocate(seq, n):
        kv.allocate(seq, n)
        return True
    return False


@dataclass
class SlotPolicy:
    """Static k, or the confidence scheduler (calibrator + step-cost table) when adaptive."""

    k: int
    max_model_len: int
    calibrator: SurvivalCalibrator | None = None
    cost: StepCostTable | None = None
    cost_shapes: list[str] = field(default_factory=list)  # per profiled count: how it was timed (spec/cost_profile.py)
    draft_seconds: float = 0.0  # the last steps' drafting time (moving average), for the admission
    # MTP drafting seconds by drafting sequences and chain length, profiled at start-up (spec/draft_cost.py); when
    # set, the admission charges it at this step's drafting sequences in place of draft_seconds (measured at another
    # load, or stale), and the adaptive scheduler chooses the next chain's length with it
    draft_cost: DraftCostTable | None = None
    # adaptive: when the admission verifies nothing (speculation does not pay at this load by the cost model),
    # drafting stops for probe_every steps (plain decode steps); then one probe step verifies the full static
    # drafts of probe_seqs sequences (the calibrator learns every slot's acceptance, which a step admitting
    # nothing never shows it),
    # and the admission decides again. Both are fixed before the step's draws: non-anticipating. Each pause
    # in a row doubles the next one (up to max_probe_every), so a load where speculation never pays costs
    # a vanishing share of probe steps; an admission that verifies something resets it.
    probe_every: int = 32
    min_probe_every: int = 32
    max_probe_every: int = 1024
    paused: int = 0
    probe: bool = True  # the next step with drafts verifies them in full (the first one does)
    probe_seqs: int = 4  # adaptive probes verify the drafts of at most this many sequences (a bounded cost)
    # adaptive with a drafting table: the length of the next MTP chain, chosen with each step's admission (the L of
    # 1..k whose steady state, drafts of L verified by the admission and chains of L drafted, has the best expected
    # tokens per second); a chain shorter than k is lengthened to k once every explore_every such steps, so the
    # deeper slots' confidences are seen again (the admission then decides on them like on any draft)
    chain: int = 0  # 0: k
    explore_every: int = 64
    _short_chains: int = 0
    # per slot: a moving average of the drafts' confidences, standing for the slots a shorter chain did not draft
    mean_confidence: list[float] = field(default_factory=list)

    @property
    def adaptive(self) -> bool:
        return self.calibrator is not None

    def chain_length(self) -> int:
        """Drafts the next MTP chain makes: the static k, or the adaptive choice (k before a probe step)."""
        if not self.adaptive or self.probe or self.chain <= 0 or self.draft_cost is None:
            return self.k
        return min(self.chain, self.k)

    def drafting_seconds(self, num_seqs: int, chain: int | None = None) -> float:
        """What drafting chains of `chain` (default k) for num_seqs sequences costs (the sequences sampling this
        step draft after it)."""
        if self.draft_cost is None:
            return self.draft_seconds
        return self.draft_cost.cost(num_seqs, chain)

    def counts(self, held: list[HeldDraft], caps: list[int], base_tokens: int, base_yield: int) -> list[int]:
        if not self.adaptive:
            return [min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)]
        if self.probe:  # the first sequences in batch order: chosen before any draw, whatever the drafts
            self.probe = False
            return [min(c, self.k, len(h.tokens)) if i < self.probe_seqs else 0
                    for i, (h, c) in enumerate(zip(held, caps))]
        self._track_confidence(held)
        lens = torch.tensor([min(c, self.k, len(h.tokens)) for h, c in zip(held, caps)], dtype=torch.int64)
        if self.draft_cost is None:  # one drafting cost (n-gram's moving average): the chain is always k
            counts = self._admit(held, lens, base_tokens, base_yield, self.drafting_seconds(base_yield))
        else:
            chain = self._choose_chain(held, caps, base_tokens, base_yield)
            counts = self._admit(held, lens.clamp(max=chain), base_tokens, base_yield,
                                 self.drafting_seconds(base_yield, chain))
            self.chain = chain
            if chain < self.k and any(counts):
                self._short_chains += 1
                if self._short_chains >= self.explore_every:
                    self._short_chains = 0
                    self.chain = self.k  # the next chain only: the next admission chooses again
        if not any(counts):
            self.paused = self.probe_every
            self.probe_every = min(2 * self.probe_every, self.max_probe_every)
        else:
            self.probe_every = self.min_probe_every
        return counts

    def _survival(self, held: list[HeldDraft], lens: torch.Tensor, width: int) -> torch.Tensor:
        """[B, width] calibrated survival; slots past a draft's own tokens take the slot's mean confidence."""
        conf = torch.zeros(len(held), width, dtype=torch.float64)
        for i, h in enumerate(held):
            n = min(int(lens[i]), width)
            own = min(n, len(h.confidence))
            conf[i, :own] = torch.tensor(h.confidence[:own], dtype=torch.float64)
            for j in range(own, n):
                conf[i, j] = self.mean_confidence[j] if j < len(self.mean_confidence) else 0.5
        slots = torch.arange(width).expand(len(held), width)
        return self.calibrator.estimate(slots, conf)

    def _admit(self, held: list[HeldDraft], lens: torch.Tensor, base_tokens: int, base_yield: int,
               speculation_seconds: float):
        width = max(int(lens.max()) if lens.numel() else 0, 1)
        survival = self._survival(held, lens, width)
        return admit(survival, lens, self.cost, base_tokens, float(base_yield),
                     speculation_seconds=speculation_seconds).num_slots.tolist()

    def _choose_chain(self, held: list[HeldDraft], caps: list[int], base_tokens: int, base_yield: int) -> int:
        """The chain length L in 1..k with the best expected tokens per second in steady state: every sequence
        holding a draft of L (its own confidences, the slot's mean beyond them), the admission's best prefix of
        those slots, and chains of L drafted after the step. Reads confidences and calibration only (fixed before
        the step's draws, and before the draws of the step the chain drafts for)."""
        caps_t = torch.tensor([min(c, self.k) for c in caps], dtype=torch.int64)
        survival = self._survival(held, caps_t, max(self.k, 1))
        best, best_rate = 1, -1.0
        for chain in range(1, self.k + 1):
            lens = caps_t.clamp(max=chain)
            a = admit(survival[:, :chain], lens, self.cost, base_tokens, float(base_yield),
                      speculation_seconds=self.drafting_seconds(base_yield, chain))
            rate = a.expected_tokens / a.expected_seconds
            if rate > best_rate * (1 + 1e-9):  # ties: the shorter chain
                best, best_rate = chain, rate
        return best

    def _track_confidence(self, held: list[HeldDraft], decay: float = 0.9) -> None:
        """Moving average per slot of the confidences the drafts hold (what a slot not drafted stands for)."""
        for j in range(self.k):
            vals = [h.confidence[j] for h in held if j < len(h.confidence)]
            if not vals:
                continue
            m = sum(vals) / len(vals)
            if j < len(self.mean_confidence):
                self.mean_confidence[j] = decay * self.mean_confidence[j] + (1 - decay) * m
            else:
                self.mean_confidence.append(m)


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
        while k > 0 and not _extend(kv, item.seq, 1 + k):
            k -= 1
        if k > 0:
            item.draft = held.tokens[:k]
            item.num_tokens = 1 + k
            confidence[index] = held.confidence[:k]
            left -= k
    return confidence
