"""Realized tokens per second of the engine's steady steps, by load bucket and chain length (0: plain decoding).

Why. The adaptive plan (spec/slot_policy.py: SlotPolicy.chain_rates) models each chain length's tokens per second
from the calibrated survival of the drafts and the step tables corrected by measured step times
(spec/step_times.py). A model can be wrong in ways its own corrections do not see: on the H200 (2026-12-04,
c32592e) its plan at 256 sequences priced a chain of 5 at 1.26x plain decoding where the static k = 5 rows ran
1.04x, so it drafted and ran 0.84x of speculation off; at one sequence the plan landed on either side of the
break-even from run to run (tau 5.08, 2.49, 1.04) where static k = 5 ran ~2x. What a plan actually gave at a
load is measured by the steps that ran it: the tokens they emitted over their wall time, every cost included
(verification, drafting, the admission's own host time, output processing).

What. For each (load, chain) a moving average of tokens and of seconds over its steady steps (a step that
verified the previous step's chain of L and drafted a chain of L again for every sequence; for plain decoding,
one that neither verified nor drafted); their quotient is the realized rate. `gains` gives each measured chain's
realized rate over plain decoding's at one load where both are measured and fresh (observed within max_age steps
of the engine's: a measure at a load left long ago is not trusted, so the plan models it again, and drafting it
measures it afresh): the load in the asked load's bucket nearest to it. SlotPolicy._choose_chain puts those gains
in place of the model's: the model proposes what was not measured, the measure decides what was.
Non-anticipating: past steps only.

Why by the exact load (since 2026-12-05, session 18; before, by load bucket). A bucket spans loads up to 2x apart,
and where a step's time is mostly per-step host work (the H200 at these shapes: plain steps ~0.9 ms at 32
sequences, ~1.4 ms at 64) its tokens per second grow with the load. The moving averages follow the latest steps, and
drafting's latest steps at a load are the run's tail: a draft of 3-5 tokens ends each sequence at its own step, so
the load falls step by step, while a pause's plain steps keep the batch whole. On the H200 (2026-12-05, 6829d96) the
measures at 33-64 sequences ended at 0.89x plain decoding for a chain of 5 (31,462 against 35,415 tok/s), below the
pause margin, where static k5 ran 1.22x of off at 64 sequences, and the adaptive mode's third timed run there paused
108 steps (97 tok/s per user against 705 in the run before). Compared at one load, the load's own speed cancels.

Why paired tokens (since 2026-12-07, session 39; `paired`). A chain's tokens a step move with the moment of a closed
batch it was drafted in: on H100s (session 38's plan traces) a chain of 5 ran 4.5-9k tok/s at 4 sequences in a
batch's first ~20 steps and 14-19k later, so a chain measured at a batch's start lost to one measured in its middle,
and the plan switched on the batch's phase, not on the chains. A step that verified a chain of L also says what a
shorter chain l would have emitted on the same step: the MTP chain drafts its first l tokens the same way whatever
its length, and the verification accepts a prefix, so a sequence that emitted e tokens would have emitted
min(e, l + 1) (`counterfactual`; where the admission verified fewer slots than l, the same fewer: the admission
decides a slot by its own survival). So the tokens of every chain up to the longest measured at a load are taken
from that chain's steps, the same steps for all (each chain's seconds still from its own steps: a step's time
follows its rows and its drafting, not the text), and chains are compared at one moment of the batch. A chain
longer than the longest measured has no such count; a challenge of it measures every shorter one on its steps too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.spec.step_times import load_bucket


@dataclass
class RealizedRates:
    """Moving averages of tokens and seconds per steady step, by (load, chain); chain 0 is plain decoding."""

    weight: float = 0.2  # of a new step, after the first min_count (which start the averages at their medians)
    min_count: int = 3  # steps of a (load, chain) before its rate is trusted
    # a (bucket, chain)'s first steady steps are not counted: on the H200 (2026-12-04, 1d0d68c, 7d1d4c1) the first
    # three of a chain at a load ran 0.5-0.6x of its later ones (first replays, allocations), and a trusted measure
    # from them paused loads where the chain ran 1.6x plain decoding later
    warm_steps: int = 2
    max_age: int = 2048  # engine steps after its last step that a (load, chain) stays trusted
    spread: float = 2.0  # a later step's seconds move the average by at most this factor's pull (a stall)
    # False: measured and reported, never deciding (tests that stand a memory-bound device's tables in for the
    # CPU's, where the CPU's own measure would overrule them)
    decides: bool = True
    tokens: dict[tuple[int, int], float] = field(default_factory=dict)  # by (load, chain)
    seconds: dict[tuple[int, int], float] = field(default_factory=dict)
    counts: dict[tuple[int, int], int] = field(default_factory=dict)
    last: dict[tuple[int, int], int] = field(default_factory=dict)  # the engine step of the last observation
    now: int = 0  # engine steps observed or skipped (`tick`)
    _first: dict[tuple[int, int], list[tuple[float, float]]] = field(default_factory=dict)
    _warm: dict[tuple[int, int], int] = field(default_factory=dict)  # by (bucket, chain): steps not counted yet
    _loads: dict[int, set[int]] = field(default_factory=dict)  # bucket -> the loads counted there
    # by (load, chain): moving averages of a step's own rate (tokens / seconds) and of its square, for the noise of
    # the measure (`separation`): a step's tokens vary with its acceptance, so a few steps' rate is a loose measure
    _step_rate: dict[tuple[int, int], float] = field(default_factory=dict)
    _step_rate_sq: dict[tuple[int, int], float] = field(default_factory=dict)
    # a list: every observed steady step is appended to it as (engine step, load, chain, tokens, seconds)
    # (benchmarks/speculative.py --plan-trace)
    trace: list | None = None
    # the tokens a chain's rate is priced by: the counterfactual tokens on the longest measured chain's steps at the
    # load (module docstring, "Why paired tokens"); False: each chain's own steps' tokens, as before session 39
    paired: bool = True
    # by (load, chain L): moving averages, over L's steady steps, of how many sequences emitted e tokens (index e,
    # 0..L + 1); the tokens chains 0..L would have emitted follow from them (`paired_tokens`), a linear map, so
    # averaging the counts averages the tokens, and a step pays only the counts' update (~2 us at 16 sequences
    # against ~7 for the tokens of every chain)
    emitted: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    _longest: int = 0  # the longest chain with counterfactual tokens observed (the paired lookup's upper end)
    # steps a chain's counts must hold before they stand in for the model's tokens (`paired_near`): a step's tokens
    # vary from 1 to L + 1 a sequence, and the model's tokens (the calibrated survival) are an engine-life average;
    # in benchmarks/spec_policy_sim.py at one sequence, three measuring steps that each emitted 2 tokens put a chain
    # of 5 at a chain of 1's yield and the plan drafted chains of 1 for a whole run (0.94 of the best static k)
    paired_min_steps: int = 8

    def tick(self) -> None:
        """One engine step passed (observed or not): ages every measure."""
        self.now += 1

    def step(self, num_seqs: int, before: int, now: int, verified: bool, tokens: int, seconds: float,
             ended: bool = False, emitted: list[int] | None = None) -> None:
        """One engine step of decode rows (a step that caught up a pause's MTP rows, or ran a prompt chunk, is not
        passed): before / now are the chains drafted for every sampling sequence by the step before and by this
        one (0: none; -1: some sequences only, a probe or an exploration, or mixed lengths). Observed where steady:
        the same chain before and now (drafting's cost and its verification's yield are of one plan), and for
        plain decoding nothing verified. Every step ages the measures.

        ended: a request ended in this step (its max_tokens, a stop): not observed. Its verification was cut to
        the tokens the request had left (spec/draft_slots.py length_cap), so the step measures the request's end,
        not the chain: at one sequence every closed batch ends on such a step (1 to k + 1 tokens where its chain
        yields ~k + 1), which pulled the chain's moving average ~8% low into the next batch's first plans (on an
        H100, 2026-12-07, session 38: chain 5 measured at 4,622 tok/s at one sequence after a cell where it
        ran ~5,700, and the next cell drafted chains of 3 for 123 steps).

        emitted: how many sampling sequences emitted each count of tokens this step (emitted[e]: those that emitted
        e, e = 0..now + 1); kept where given, for the shorter chains' tokens on this step (`paired_tokens`)."""
        self.tick()
        if before != now or now < 0 or (now == 0 and verified):
            return
        if ended:
            if self.trace is not None:
                self.trace.append((self.now, int(num_seqs), now, tokens, round(seconds, 6), "ended"))
            return
        self.observe(num_seqs, now, tokens, seconds, emitted if now > 0 else None)

    def observe(self, num_seqs: int, chain: int, tokens: int, seconds: float,
                emitted: list[int] | None = None) -> None:
        """A steady step at num_seqs sampling sequences that ran a chain of `chain` (0: plain), emitting `tokens`
        in `seconds` of wall time (output processing included: every token pays it, however it is emitted).
        emitted: how many sequences emitted each count of tokens (emitted[e], e = 0..chain + 1), where known."""
        if chain < 0 or tokens <= 0 or seconds <= 0 or num_seqs <= 0:
            return
        key = (int(num_seqs), chain)
        self.last[key] = self.now
        if self.trace is not None:
            self.trace.append((self.now, key[0], chain, tokens, round(seconds, 6)))
        warm_key = (load_bucket(num_seqs), chain)
        warm = self._warm.get(warm_key, 0)
        if warm < self.warm_steps:
            self._warm[warm_key] = warm + 1
            return
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        if n == 1:
            self._loads.setdefault(warm_key[0], set()).add(key[0])
        if emitted is not None and len(emitted) == chain + 2:
            self._observe_emitted(key, emitted, n)
        if n <= self.min_count:  # the median of the first steps (one may have compiled a kernel)
            first = self._first.setdefault(key, [])
            first.append((float(tokens), seconds))
            rates = sorted(first, key=lambda ts: ts[0] / ts[1])
            self.tokens[key], self.seconds[key] = rates[(len(rates) - 1) // 2]
            mid = [t / s for t, s in rates]  # (a stall among them widens the noise: a cautious measure)
            self._step_rate[key] = sum(mid) / len(mid)
            self._step_rate_sq[key] = sum(r * r for r in mid) / len(mid)
            if n == self.min_count:
                del self._first[key]
            return
        self._average(key, tokens, seconds)

    def _average(self, key: tuple[int, int], tokens: int, seconds: float) -> None:
        """A counted step past a (load, chain)'s first min_count into its moving averages (a stall's seconds pulled
        in to within spread of the average's per-token seconds)."""
        avg_t, avg_s = self.tokens[key], self.seconds[key]
        per_token = avg_s / avg_t
        s = min(max(seconds, tokens * per_token / self.spread), tokens * per_token * self.spread)
        w = self.weight
        self.tokens[key] = (1 - w) * avg_t + w * tokens
        self.seconds[key] = (1 - w) * avg_s + w * s
        r = tokens / s
        self._step_rate[key] = (1 - w) * self._step_rate[key] + w * r
        self._step_rate_sq[key] = (1 - w) * self._step_rate_sq[key] + w * r * r

    def steady_step(self, num_seqs: int, chain: int, tokens: int, seconds: float, lens: bytes) -> None:
        """`step(num_seqs, chain, chain, ...)` of a steady drafting step that no request ended in, with each sampling
        sequence's tokens emitted (lens: one byte a sequence): the same updates (and trace entry). Where the (load,
        chain) is past its first min_count steps with counts kept, they run here without step's and observe's
        checks (every one of which such a step passes): the adaptive mode's settled steps each make one such call
        (spec/verify_outcomes.py); through step and observe that cost 6-8 us a step inside an engine step on this CPU
        (session 42, one sequence: the largest piece of the mode's ~15 us of deferred work over static k5's), ~4
        by this path."""
        key = (num_seqs, chain)
        old = self.emitted.get(key)
        fits = max(lens, default=0) <= chain + 1  # (a sequence past the chain's tokens: no counts, none wrong)
        if old is None or self.counts.get(key, 0) < self.min_count or tokens <= 0 or seconds <= 0 or not fits:
            counts = [lens.count(e) for e in range(chain + 2)] if fits else None
            self.step(num_seqs, chain, chain, True, tokens, seconds, emitted=counts)
            return
        self.now += 1
        self.last[key] = self.now
        if self.trace is not None:
            self.trace.append((self.now, num_seqs, chain, tokens, round(seconds, 6)))
        self.counts[key] += 1
        w = self.weight
        # `_observe_emitted`'s (1 - w) * o + w * x, x the count of sequences that emitted e: for a count of 0 the
        # sum is its first term, so only the counts seen are added (the same floats)
        new = [(1 - w) * o for o in old]
        if len(lens) == 1:
            new[lens[0]] += w
        else:
            for e in set(lens):
                new[e] += w * lens.count(e)
        self.emitted[key] = new
        self._average(key, tokens, seconds)

    def _observe_emitted(self, key: tuple[int, int], emitted: list[int], n: int) -> None:
        """One steady step's counts of sequences by tokens emitted into the (load, chain)'s averages: the mean of its
        first min_count steps, then the moving average (its own tokens' median start is for a rate; these are counts,
        compared with each other on the same steps)."""
        old = self.emitted.get(key)
        if old is None:
            self.emitted[key] = [float(x) for x in emitted]
            self._longest = max(self._longest, key[1])
            return
        w = 1.0 / n if n <= self.min_count else self.weight
        self.emitted[key] = [(1 - w) * o + w * x for o, x in zip(old, emitted)]

    def paired_near(self, num_seqs: int, chain: int | None = None) -> list[float] | None:
        """The tokens chains 0..M would have emitted a step on the steps of M (`paired_tokens`), at the load of
        num_seqs's bucket nearest to it where M has counts and is trusted: M is `chain` where given, else the longest
        chain trusted there. None where there is none, where M's counts hold fewer than paired_min_steps steps, or
        not paired. What the plan's model may take its tokens from (spec/chain_plan.py `_paired_tokens`)."""
        if not self.paired or not self.decides:
            return None
        for load in self._loads_near(num_seqs):
            m = self._counted_chain(load, 1) if chain is None else chain if self._counted(load, chain) else 0
            if m > 0:
                return counterfactual(self.emitted[(load, m)], m) \
                    if self.counts[(load, m)] >= self.paired_min_steps else None
        return None

    def paired_with_seconds(self, num_seqs: int, chain: int) -> tuple[list[float], float] | None:
        """`paired_near(num_seqs, chain)` and the seconds of a steady step of `chain` at the same load (its moving
        average): the tokens every shorter chain would have emitted on chain's steps, and what those steps took.
        None where paired_near is None. What a challenge's reach is bounded by (spec/chain_challenge.py)."""
        if not self.paired or not self.decides:
            return None
        for load in self._loads_near(num_seqs):
            if self._counted(load, chain):
                if self.counts[(load, chain)] < self.paired_min_steps:
                    return None
                return counterfactual(self.emitted[(load, chain)], chain), self.seconds[(load, chain)]
        return None

    def paired_tokens(self, load: int, chain: int) -> list[float] | None:
        """The average tokens chains 0..chain would have emitted on the steady steps of chain at this load
        (`counterfactual` of the averaged counts), None where none was counted."""
        counts = self.emitted.get((load, chain))
        return None if counts is None else counterfactual(counts, chain)

    def forget_drafting(self, num_seqs: int) -> None:
        """Forget the drafting measures of this load's bucket (plain decoding's stay): a pause that ends probes the
        load again, and the plan after it is the model's until drafting is measured afresh. A pause decided on a
        drafting measure would otherwise never end in drafting (its chain does not run, so its measure is never
        refreshed): on the H200 (2026-12-04, 1d0d68c) three measuring steps in the benchmark's warm-up put a chain
        of 5 at one sequence at 1,200 tok/s against plain decoding's 1,808, and the adaptive mode paused through
        every timed run there, where static k = 5 ran 3,640."""
        bucket = load_bucket(num_seqs)
        for key in [key for key in self.last if load_bucket(key[0]) == bucket and key[1] > 0]:
            self._drop(key)
        for key in [key for key in self._warm if key[0] == bucket and key[1] > 0]:
            del self._warm[key]

    def forget_chain(self, num_seqs: int, chain: int) -> None:
        """Forget one chain's measures at the loads of num_seqs's bucket (its warm-up stays done): a challenge
        (spec/chain_challenge.py) measures it afresh, so the plan after compares two measures of recent steps
        rather than a fresh one with one taken long before, at another moment of the machine."""
        bucket = load_bucket(num_seqs)
        for key in [key for key in self.last if load_bucket(key[0]) == bucket and key[1] == chain]:
            self._drop(key)

    def _drop(self, key: tuple[int, int]) -> None:
        """Forget one (load, chain)'s measure (its bucket's warm-up count stays)."""
        for table in (self.tokens, self.seconds, self.counts, self.last, self._first, self._step_rate,
                      self._step_rate_sq, self.emitted):
            table.pop(key, None)

    def steps_near(self, num_seqs: int) -> dict[int, int]:
        """Steps counted for each chain (0: plain) measured and fresh at the load of num_seqs's bucket nearest to it
        where any is; empty where none is."""
        for load in self._loads_near(num_seqs):
            got = {c: n for (ld, c), n in self.counts.items() if ld == load and self._trusted((ld, c))}
            if got:
                return got
        return {}

    def _noise(self, key: tuple[int, int]) -> float:
        """The standard error of a (load, chain)'s realized rate: its steps' rate spread over the steps its average
        holds (the moving average's weight w holds (2 - w) / w of them, 9 at 0.2; fewer while it has fewer)."""
        var = max(self._step_rate_sq[key] - self._step_rate[key] ** 2, 0.0)
        held = min(self.counts[key], (2.0 - self.weight) / self.weight)
        return (var / held) ** 0.5

    def separation(self, num_seqs: int, a: int, b: int) -> float | None:
        """(rate of chain a - rate of chain b) over their measures' combined standard error, at the load of
        num_seqs's bucket nearest to it where both are measured and fresh; None where none is. What the plan asks
        before a measure overrules the model's order of two chains (spec/chain_plan.py)."""
        if not self.decides:
            return None
        for load in self._loads_near(num_seqs):
            ka, kb = (load, a), (load, b)
            if ka in self.counts and kb in self.counts and self._trusted(ka) and self._trusted(kb):
                diff = self._rate_at(ka) - self._rate_at(kb)
                se = (self._noise(ka) ** 2 + self._noise(kb) ** 2) ** 0.5
                return diff / se if se > 0 else (float("inf") if diff > 0 else float("-inf") if diff < 0 else 0.0)
        return None

    def _trusted(self, key: tuple[int, int]) -> bool:
        return self.counts.get(key, 0) >= self.min_count and self.now - self.last[key] <= self.max_age

    def _loads_near(self, num_seqs: int) -> list[int]:
        """The measured loads of num_seqs's bucket, nearest to it first (ties: the higher)."""
        loads = self._loads.get(load_bucket(num_seqs), ())
        return sorted(loads, key=lambda load: (abs(load - num_seqs), -load))

    def rate(self, num_seqs: int, chain: int) -> float | None:
        """Realized tokens per second of a chain at the load of num_seqs's bucket nearest to it where the chain is
        measured and fresh, or None (not measured there, or stale)."""
        if not self.decides:
            return None
        key = (int(num_seqs), chain)
        if key in self.counts and self._trusted(key):  # (every drafting step asks: the common case first)
            return self._rate_at(key)
        for load in self._loads_near(num_seqs):
            if self._trusted((load, chain)):
                return self._rate_at((load, chain))
        return None

    def gains(self, num_seqs: int, k: int) -> dict[int, float]:
        """Realized rate over plain decoding's, for each chain 1..k measured at one load with plain decoding (the
        load of num_seqs's bucket nearest to it where both are measured and fresh); empty where none is."""
        if not self.decides:
            return {}
        out = {}
        loads = self._loads_near(num_seqs)
        for chain in range(1, k + 1):
            for load in loads:
                if self._trusted((load, chain)) and self._trusted((load, 0)):
                    out[chain] = self._rate_at((load, chain)) / self._rate_at((load, 0))
                    break
        return out

    def chains_at_one_load(self, num_seqs: int, k: int) -> dict[int, tuple[float, int]]:
        """(realized rate, steps) of each chain 1..k measured and fresh at one load, the load of num_seqs's bucket
        nearest to it where at least two chains are: chains compared with each other where plain decoding was not
        measured there (`gains` needs it; a load that never paused has none). Empty where no load has two."""
        if not self.decides:
            return {}
        for load in self._loads_near(num_seqs):
            got = {c: (self._rate_at((load, c)), self.counts[(load, c)])
                   for c in range(1, k + 1) if (load, c) in self.counts and self._trusted((load, c))}
            if len(got) >= 2:
                return got
        return {}

    def seconds_at_one_load(self, num_seqs: int, k: int) -> tuple[int, dict[int, float]] | None:
        """(load, a steady step's seconds for each chain 0..k measured and fresh there), at the load of num_seqs's
        bucket nearest to it where at least two drafting chains are; None where no load has two. What the plan fits
        the model's step times to (spec/chain_plan.py `_fitted_rates`)."""
        if not self.decides:
            return None
        for load in self._loads_near(num_seqs):
            got = {c: self.seconds[(load, c)] for c in range(k + 1) if (load, c) in self.counts
                   and self._trusted((load, c))}
            if sum(1 for c in got if c > 0) >= 2:
                return load, got
        return None

    def _rate_at(self, key: tuple[int, int]) -> float:
        """A trusted (load, chain)'s realized rate: its tokens a step over its own steps' seconds; paired, the tokens
        it would have emitted on the steps of the longest chain trusted at the load (itself where it is the longest;
        module docstring, "Why paired tokens")."""
        load, chain = key
        m = self._counted_chain(load, chain) if self.paired else 0
        if m:
            return _tokens_of(self.emitted[(load, m)], chain) / self.seconds[key]
        return self.tokens[key] / self.seconds[key]

    def _counted(self, load: int, chain: int) -> bool:
        """Whether a chain is trusted at this load and its steps' counts were kept (`_observe_emitted`)."""
        return (load, chain) in self.emitted and self._trusted((load, chain))

    def _counted_chain(self, load: int, shortest: int) -> int:
        """The longest chain at least `shortest` long that is `_counted` at this load, 0 where none is."""
        return next((m for m in range(self._longest, shortest - 1, -1) if m > 0 and self._counted(load, m)), 0)

    def paired_rows(self, load: int) -> list[tuple[int, float]]:
        """(chain, rate) of each chain trusted at this load as the plan prices it (`_rate_at`): plan traces."""
        return [(c, self._rate_at((ld, c))) for ld, c in sorted(self.tokens) if ld == load and self._trusted((ld, c))]

    def rows(self) -> list[tuple[int, int, float, int]]:
        """(load, chain, tokens per second, steps), sorted: what benchmarks print."""
        return [(b, c, self.tokens[(b, c)] / self.seconds[(b, c)], self.counts[(b, c)])
                for b, c in sorted(self.tokens)]


def counterfactual(counts: list[float], chain: int) -> list[float]:
    """The tokens chains 0..chain would have emitted on a step that verified chains of `chain`, from how many
    sequences emitted each count of tokens (counts[e]: sequences that emitted e): a sequence that emitted e tokens
    (e - 1 drafts accepted, then the target's token) would have emitted min(e, l + 1) with a chain of l, whose
    drafts are the chain's first l and whose verification accepts the same prefix of them (module docstring)."""
    return [_tokens_of(counts, length) for length in range(chain + 1)]


def _tokens_of(counts: list[float], chain: int) -> float:
    """`counterfactual`'s entry for a chain of `chain`: what the counted sequences would have emitted with it."""
    return sum(n * min(e, chain + 1) for e, n in enumerate(counts))
