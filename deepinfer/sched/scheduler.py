"""Continuous batching under a token budget, with chunked prefill and preemption by recompute.

Each step: running decodes first (one token each), then running sequences that
are part-way through their prompt (or a recompute), then waiting sequences in
arrival order. A sequence whose tokens do not fit the budget gets a chunk (with
chunked prefill on). When KV blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed and it goes to the front of the
waiting queue, to recompute prompt + generated tokens later.

With prefix caching a sequence being admitted (new, or preempted) first attaches the cached blocks
of its longest keyed prefix and is scheduled from there; its full blocks are keyed as they are
computed, so a preempted sequence finds its own blocks again unless they were evicted meanwhile. A prefix
whose blocks are on disk is read on a thread pool while the step runs the others; the sequence is admitted
once its reads are done (kv/tier_link.py).

At most min(max_num_seqs, max_num_batched_tokens) sequences run at once, so every
running sequence can decode every step (none starves behind a full budget).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from deepinfer.kv.manager import KVCacheManager
from deepinfer.sched.request import SeqStatus, Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # tokens computed this step, starting at seq.num_computed_tokens (drafted ones included)
    context_len: int  # seq.num_computed_tokens when scheduled
    # speculative decoding (spec/): drafted tokens verified after the sequence's last token; they are the
    # last len(draft) of num_tokens and never part of seq until accepted
    draft: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the sequence's last token, so it draws the next one."""
        return self.context_len + self.num_tokens - len(self.draft) == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool = True,
    ):
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_running = min(max_num_seqs, max_num_batched_tokens)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the tail is preempted first
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue changes

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and free its blocks at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ------------------------------------------------------------ one step

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, ScheduledSeq] = {}  # id(seq) -> entry

        for seq in self._running_in_order():
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = self._tokens_for(seq, budget)
            if n == 0:
                continue
            if self.kv.try_extend(seq, n):  # no new block needed: the common decode step
                scheduled[id(seq)] = ScheduledSeq(seq, n, seq.num_computed_tokens)
                budget -= n
                continue
            while not self.kv.can_allocate(seq, n):
                victim = self.running[-1]
                if id(victim) in scheduled:
                    budget += scheduled.pop(id(victim)).num_tokens
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                continue
            self.kv.allocate(seq, n)
            scheduled[id(seq)] = ScheduledSeq(seq, n, seq.num_computed_tokens)
            budget -= n

        # Admit waiting sequences (preempted ones are at the front) unless memory was short this step.
        while self.waiting and not out.preempted and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            # disk-tier reads of its prefix run on a thread pool: wait for them only if nothing else can run
            prefix = self.kv.match_prefix(seq, wait=not scheduled)
            if prefix is not None and not prefix.ready:
                break  # admitted in a later step, once its blocks are read (FIFO order kept)
            if prefix is not None:
                seq.num_computed_tokens = prefix.num_tokens
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    seq.num_computed_tokens = 0
                    break
                n = budget
            if not self.kv.can_allocate(seq, n, prefix):
                seq.num_computed_tokens = 0  # it holds nothing: nothing was attached
                break
            self.waiting.popleft()
            self.kv.allocate(seq, n, prefix)
            if prefix is None:
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = 0
            else:
                self.kv.prefix_queried_tokens += seq.num_tokens
                self.kv.prefix_hit_tokens += prefix.num_tokens
                if seq.num_cached_tokens is None:
                    seq.num_cached_tokens = min(prefix.num_tokens, len(seq.prompt_token_ids))
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            scheduled[id(seq)] = ScheduledSeq(seq, n, seq.num_computed_tokens)
            budget -= n

        # Batch order follows running order (stable across steps, decodes interleaved).
        out.scheduled = [scheduled[id(s)] for s in self.running if id(s) in scheduled]
        return out

    def _running_in_order(self) -> list[Sequence]:
        """Decodes first, then running sequences still working through their tokens."""
        decodes, others = [], []
        for seq in self.running:
            (others if seq.num_uncomputed_tokens > 1 else decodes).append(seq)
        return decodes + others if others else decodes

    def _tokens_for(self, seq: Sequence, budget: int) -> int:
        """Tokens a running sequence gets this step (0: none).

        With async scheduling a sequence whose pending tokens already reach max_tokens or
        max_model_len is skipped: it finishes when they are read, so a step for it would be
        discarded (sync mode has no pending tokens here, so this never applies there).
        """
        if seq.num_pending and seq.ends_by_length(self.kv.max_model_len):
            return 0
        uncomputed = seq.num_uncomputed_tokens
        n = min(uncomputed, budget)
        if n < uncomputed and not self.enable_chunked_prefill:
            return 0
        return n

    def would_preempt(self) -> bool:
        """Whether schedule() would have to preempt a running sequence now (memory short).

        Async scheduling asks before scheduling past a step in flight: if so, it resolves that
        step first, so sequences finishing in it free their blocks before anything is evicted,
        as in sync mode. O(running), O(1) per sequence on the decode fast path.
        """
        budget = self.max_num_batched_tokens
        need: dict[str, int] = {}
        for seq in self._running_in_order():
            if budget <= 0:
                break
            n = self._tokens_for(seq, budget)
            if n == 0:
                continue
            for group, k in self.kv.blocks_needed(seq, n).items():
                need[group] = need.get(group, 0) + k
            budget -= n
        return not self.kv.fits(need)

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens are in the cache; key the full blocks, then drop window
        blocks no longer read (keyed first, so a trimmed window block stays cached for later hits)."""
        for item in out.scheduled:
            item.seq.num_computed_tokens = item.context_len + item.num_tokens
            self.kv.register_computed(item.seq)
            self.kv.trim(item.seq)
