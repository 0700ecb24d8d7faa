"""Measured / table-predicted step times of the engine's decode-row steps, per load and per kind of step.

The step table (spec/cost_profile.py) and the drafting table (spec/draft_cost.py) time the forward and the drafter
alone, over no context. The engine's steps also pay the sampler, verification, output processing, batch building
and attention over real contexts, and that excess does not scale like the tables: on the H200 (2026-12-04, commit
f847f90, V2-Lite shapes with one MTP layer) a plain step at one sequence ran ~1.9x its table price and at 64
sequences ~4.4x, a k = 3 step ~1.5x and ~3.8x. One ratio per kind over all loads (what SlotPolicy kept before)
averaged those into plain 4.08 / speculative 5.90 in a benchmark that swept the loads, and priced that way the
adaptive mode drafted nothing at one sequence (tau 1.00-1.09), where static k = 3 ran 1.44x.

So the correction is kept per sequence-count bucket (the next power of two at or above the count) and per kind
(plain: a step that neither verified nor drafted; speculative: one that did both). `seconds` corrects a table price:
- a speculative price where both kinds were seen at the bucket (or the speculative kind at the bucket and plain
  steps at a bucket next to it, `plain_overhead_near`): the plain steps' excess (the per-step work every step
  pays: scheduling, batch building, the sampler's launch) plus the price scaled by what is left of the
  speculative steps' own excess, a + price x r. Since 2026-12-06 (session 28) only the forward's part of the
  price is scaled and the drafting table's part is kept as priced, a + forward x r + drafting (a = 0 where no
  plain step is near): the drafting table times the MTP pass and chain as the engine replays them, and what the
  tables do not see (verification, sampling and batch building a verified row, attention over real contexts)
  grows with the rows verified, not with the chain's drafting. Scaled whole, the drafting of a longer chain was
  overpriced by the host work of the chain the ratio was measured on (an H100 at one sequence, call 10 of
  docs/perf-log/2026-12-06-session28-h100.md: chains of 3 and 4 priced above 5 after a pause timed plain steps
  there, and the adaptive mode ran 1.43x of off where static k5 ran 1.90x). Why a at all: the excess of a step is
  mostly host work that does not grow with its price; scaled whole by the ratio of the chain observed, a longer
  chain was overpriced (benchmarks/spec_policy_sim.py
  at 64 sequences, 2026-12-04: k = 3 planned at x4.9 where k = 5 ran 1.17x faster);
- the same kind and bucket seen: price x its ratio;
- a plain step where plain steps were seen at a neighbouring bucket (half or twice this one): price x their ratio
  (`neighbour_ratio`, since 2026-12-05);
- else the same bucket's other kind seen: price + that kind's excess (measured - predicted). At one load both kinds
  pay about the same per-step host work, which does not scale with the price: on the H200 (2026-12-04, f7bf36c,
  one sequence) a plain step ran 0.295 + 0.88 ms (x3.97) and a static k = 5 step 1.03 + 1.19 ms (x2.15); the
  plain ratio would have priced the k = 5 step at 4.1 ms, its excess at 1.91 ms. This is what the adaptive mode
  plans by until it has drafted at a load (probe steps are transitions, not observed: SlotPolicy.observe_step);
- else the nearest seen bucket of the same kind, then of the other kind (their ratios), then 1 (trust the tables).
Seen means min_count observations (3): one step is not a steady state.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLAIN = "plain"
SPECULATIVE = "speculative"
KINDS = (PLAIN, SPECULATIVE)


def _other(kind: str) -> str:
    return SPECULATIVE if kind == PLAIN else PLAIN


def load_bucket(num_seqs: int) -> int:
    """The power of two at or above num_seqs (1 for 0 or 1)."""
    return 1 << max(int(num_seqs) - 1, 0).bit_length()


@dataclass
class StepTimeRatios:
    """Moving averages (weight `weight`) of measured / predicted seconds and of measured - predicted seconds, by
    (kind, load bucket). A kind's own ratio corrects its prices where it was seen; the other kind's difference stands
    in where only that one was (module docstring; a purely additive model lost to the ratios in an A/B on the CPU on
    2026-12-03, docs/speculative.md)."""

    weight: float = 0.1  # of a new observation after the first min_count (which start the averages at their medians)
    # observations of a (kind, bucket) before its own numbers price steps: on the H200 (2026-12-04, fd509cb) one
    # speculative step at x2.86 its price was all the adaptive mode had seen at one sequence, and it paused there
    min_count: int = 3
    min_ratio: float = 0.1  # clamp of one observation: a GC pause or a stall is not the model's error
    max_ratio: float = 10.0
    spread: float = 2.0  # after the first min_count: one observation moves the ratio by at most this factor's pull
    _first: dict[tuple[str, int], list[tuple[float, float, float]]] = field(default_factory=dict)
    ratios: dict[tuple[str, int], float] = field(default_factory=dict)
    overheads: dict[tuple[str, int], float] = field(default_factory=dict)
    predicted: dict[tuple[str, int], float] = field(default_factory=dict)  # moving average of the table prices
    # moving average of the drafting table's part of those prices (0 for plain steps): `seconds` keeps a chain's
    # drafting at its table price and corrects the rest (the forward and what the tables do not see)
    drafting: dict[tuple[str, int], float] = field(default_factory=dict)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)

    def observe(self, kind: str, num_seqs: int, seconds: float, predicted: float, drafting: float = 0.0) -> None:
        """One step. The first min_count observations of a (kind, bucket) start its averages at their medians, and
        later ones are clamped to within `spread` of the running ratio: a step that compiled a kernel or met a
        collector pause (tens of ms) is not what the next steps cost. On the H200 (2026-12-04, 3f48dc7) the
        adaptive mode paused at 4 sequences for its whole run where its own end-of-run plan drafted chains of 5 at
        1.5x plain decoding; a mean over the first three steps lets one such step decide. `drafting`: the part of
        `predicted` that is the drafting table's."""
        if kind not in KINDS:
            raise ValueError(f"step kind must be one of {KINDS}, got {kind!r}")
        if predicted <= 0:
            return
        key = (kind, load_bucket(num_seqs))
        x = min(max(seconds / predicted, self.min_ratio), self.max_ratio)
        n = self.counts.get(key, 0) + 1
        self.counts[key] = n
        drafting = min(max(drafting, 0.0), predicted)
        if n <= self.min_count:
            first = self._first.setdefault(key, [])
            first.append((x, (x - 1.0) * predicted, predicted, drafting))
            mid = [sorted(v)[(len(first) - 1) // 2] for v in zip(*first)]  # the lower median of each
            self.ratios[key], self.overheads[key], self.predicted[key], self.drafting[key] = mid
            self.drafting[key] = min(self.drafting[key], self.predicted[key])
            if n == self.min_count:
                del self._first[key]
            return
        r = self.ratios[key]
        x = min(max(x, r / self.spread), r * self.spread)
        w = self.weight
        self.ratios[key] = (1 - w) * r + w * x
        self.overheads[key] = (1 - w) * self.overheads[key] + w * (x - 1.0) * predicted
        self.predicted[key] = (1 - w) * self.predicted[key] + w * predicted
        self.drafting[key] = (1 - w) * self.drafting[key] + w * drafting

    def seen(self, kind: str, num_seqs: int) -> bool:
        """Whether this kind's own numbers at this load price its steps (min_count observations)."""
        return self._trusted((kind, load_bucket(num_seqs)))

    def _trusted(self, key: tuple[str, int]) -> bool:
        return self.counts.get(key, 0) >= self.min_count

    def seconds(self, kind: str, num_seqs: int, predicted: float, drafting: float = 0.0) -> float:
        """A step of this kind at this load that the tables price at `predicted` seconds (`drafting` of them the
        drafting table's), corrected (module docstring: the order of the fallbacks)."""
        bucket = load_bucket(num_seqs)
        if self._trusted((kind, bucket)):
            key = (kind, bucket)
            ad = self.drafting.get(key, 0.0)
            a = self.plain_overhead_near(num_seqs) if kind == SPECULATIVE else None
            if a is not None or ad > 0.0:  # a + forward x r + drafting (module docstring)
                a = a or 0.0
                at = self.predicted[key]
                fwd_at = max(at - ad, self.min_ratio * at)
                r = max((at + self.overheads[key] - a - ad) / fwd_at, self.min_ratio)
                drafting = min(max(drafting, 0.0), predicted)
                return max(a + (predicted - drafting) * r + drafting, self.min_ratio * predicted)
            return predicted * self.ratios[key]
        near = self.neighbour_ratio(kind, num_seqs) if kind == PLAIN else None
        if near is not None:
            return predicted * near
        other = _other(kind)
        if self._trusted((other, bucket)):
            return max(predicted + self.overheads[(other, bucket)], self.min_ratio * predicted)
        return predicted * self.ratio(kind, num_seqs)

    def plain_overhead_near(self, num_seqs: int) -> float | None:
        """The plain steps' excess (measured - predicted seconds) at the load's bucket, else the mean of the buckets
        next to it (half and twice it) where seen, else of those two doublings away, else None: the per-step work a speculative price's `a + price x r`
        takes as fixed (module docstring). Why the neighbours (since 2026-12-06, session 28): a load that never
        paused has no plain step of its own, and its speculative price was its ratio alone, which scales the
        drafting table's chain lengths by the per-step host work too. On an H100 (session 28, 7ff9dce) at one
        sequence the ratio was 1.81 (+0.50 ms): chains of 3 and 5 priced 1.108 and 1.345 ms a step (x1.21) where
        static k3 and k5 steps ran 0.966 and 1.052 ms (x1.09), and the plan put chains of 3 to 5 within 3% of each
        other and drafted 3 (k5 ran 2.29x of off, the adaptive mode 1.89x); plain steps at <= 4 sequences (two
        doublings away: the nearest seen) ran +0.52 ms, about the speculative steps' whole excess; the excess grows
        with the load (+0.55 / +0.62 / +0.89 / +1.43 ms at <= 8 / 16 / 32 / 64 there), so no farther than that."""
        bucket = load_bucket(num_seqs)
        if self._trusted((PLAIN, bucket)):
            return self.overheads[(PLAIN, bucket)]
        for step in (2, 4):  # the buckets next to it, then two doublings away (the mean where both sides are seen)
            near = [self.overheads[(PLAIN, b)] for b in (bucket // step, step * bucket) if b >= 1 and b != bucket
                    and self._trusted((PLAIN, b))]
            if near:
                return sum(near) / len(near)
        return None

    def neighbour_ratio(self, kind: str, num_seqs: int) -> float | None:
        """This kind's ratio at the buckets next to the load's (half and twice it; the mean where both are seen), or
        None. It prices plain steps at a load they were not seen at before the other kind's excess does (since
        2026-12-05; a speculative step keeps the order above: its own ratio from a neighbour would scale the
        drafting table by it, which the plain steps' excess does not): a closed batch's load falls bucket by bucket
        as its sequences end, and with plain steps priced by the speculative steps' excess at the new bucket (or
        timed by a measuring pause there, SlotPolicy._measuring), each bucket paid 8 paused steps
        (benchmarks/spec_policy_sim.py closed batches of 128 tokens, six seeds: 1.180x of off at 64 sequences
        without it, 1.211x with it; static k5 1.261x)."""
        bucket = load_bucket(num_seqs)
        near = [self.ratios[(kind, b)] for b in (bucket // 2, 2 * bucket) if b >= 1 and b != bucket
                and self._trusted((kind, b))]
        return sum(near) / len(near) if near else None

    def ratio(self, kind: str, num_seqs: int) -> float:
        """This kind's ratio at the load's bucket, else at the nearest seen bucket of this kind, then of the other
        kind, else 1 (seen: min_count observations)."""
        bucket = load_bucket(num_seqs)
        for k in (kind, _other(kind)):
            seen = [b for (kk, b) in self.ratios if kk == k and self._trusted((kk, b))]
            if seen:  # nearest on the log scale; ties: the smaller load
                near = min(seen, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
                return self.ratios[(k, near)]
        return 1.0

    def overhead(self, kind: str, num_seqs: int) -> float | None:
        """This kind's measured - predicted seconds at the load's bucket (None: not seen)."""
        return self.overheads.get((kind, load_bucket(num_seqs)))

    def rows(self) -> list[tuple[str, int, float, float, int]]:
        """(kind, bucket, ratio, overhead seconds, observations), sorted: what benchmarks print."""
        return [(k, b, self.ratios[(k, b)], self.overheads[(k, b)], self.counts[(k, b)])
                for k, b in sorted(self.ratios, key=lambda kb: (KINDS.index(kb[0]), kb[1]))]
