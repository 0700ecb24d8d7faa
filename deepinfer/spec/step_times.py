"""Measured / table-predicted step times of the engine's decode-row steps, per load and per kind of step.

The step table (spec/cost_profile.py) and the drafting table (spec/draft_cost.py) time the forward and the drafter
alone, over no context. The engine's steps also pay the sampler, verification, output processing, batch building
and attention over real contexts, and that excess does not scale like the tables: on the H200 (2026-12-04, commit
f847f90, V2-Lite shapes with one MTP layer) a plain step at one sequence ran ~1.9x its table price and at 64
sequences ~4.4x, a k = 3 step ~1.5x and ~3.8x. One ratio per kind over all loads (what SlotPolicy kept before)
averaged those into plain 4.08 / speculative 5.90 in a benchmark that swept the loads, and priced that way the
adaptive mode drafted nothing at one sequence (tau 1.00-1.09), where static k = 3 ran 1.44x.

So the correction is kept per sequence-count bucket (the next power of two at or above the count) and per kind
(plain: a step that neither verified nor drafted; speculative: one that did). Lookup for a bucket never seen:
the same bucket's other kind (at one load both kinds pay the same per-step host work, and the two kinds' ratios
were within 1.3x of each other on the H200 where loads differed 2.3x), then the nearest seen bucket of the same
kind, then of the other kind, then 1 (trust the tables).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PLAIN = "plain"
SPECULATIVE = "speculative"
KINDS = (PLAIN, SPECULATIVE)


def load_bucket(num_seqs: int) -> int:
    """The power of two at or above num_seqs (1 for 0 or 1)."""
    return 1 << max(int(num_seqs) - 1, 0).bit_length()


@dataclass
class StepTimeRatios:
    """Moving averages (weight `weight`) of measured / predicted seconds and of measured - predicted seconds, by
    (kind, load bucket). The ratio plans (SlotPolicy._choose_chain); the difference is reported only (an additive
    model lost to the ratios in an A/B on 2026-12-03, docs/speculative.md)."""

    weight: float = 0.1
    min_ratio: float = 0.1  # clamp of one observation: a GC pause or a stall is not the model's error
    max_ratio: float = 10.0
    ratios: dict[tuple[str, int], float] = field(default_factory=dict)
    overheads: dict[tuple[str, int], float] = field(default_factory=dict)
    counts: dict[tuple[str, int], int] = field(default_factory=dict)

    def observe(self, kind: str, num_seqs: int, seconds: float, predicted: float) -> None:
        if kind not in KINDS:
            raise ValueError(f"step kind must be one of {KINDS}, got {kind!r}")
        if predicted <= 0:
            return
        key = (kind, load_bucket(num_seqs))
        x = min(max(seconds / predicted, self.min_ratio), self.max_ratio)
        over = (x - 1.0) * predicted
        w = self.weight
        self.ratios[key] = x if key not in self.ratios else (1 - w) * self.ratios[key] + w * x
        self.overheads[key] = over if key not in self.overheads else (1 - w) * self.overheads[key] + w * over
        self.counts[key] = self.counts.get(key, 0) + 1

    def seen(self, kind: str, num_seqs: int) -> bool:
        return (kind, load_bucket(num_seqs)) in self.ratios

    def ratio(self, kind: str, num_seqs: int) -> float:
        """The correction for a step of this kind at this load (see the module docstring for the fallbacks)."""
        key = self._lookup(kind, load_bucket(num_seqs))
        return 1.0 if key is None else self.ratios[key]

    def overhead(self, kind: str, num_seqs: int) -> float | None:
        key = self._lookup(kind, load_bucket(num_seqs))
        return None if key is None else self.overheads[key]

    def _lookup(self, kind: str, bucket: int) -> tuple[str, int] | None:
        other = SPECULATIVE if kind == PLAIN else PLAIN
        for key in ((kind, bucket), (other, bucket)):
            if key in self.ratios:
                return key
        for k in (kind, other):
            seen = [b for (kk, b) in self.ratios if kk == k]
            if seen:  # nearest on the log scale; ties: the smaller load
                near = min(seen, key=lambda b: (abs(b.bit_length() - bucket.bit_length()), b))
                return (k, near)
        return None

    def rows(self) -> list[tuple[str, int, float, float, int]]:
        """(kind, bucket, ratio, overhead seconds, observations), sorted: what benchmarks print."""
        return [(k, b, self.ratios[(k, b)], self.overheads[(k, b)], self.counts[(k, b)])
                for k, b in sorted(self.ratios, key=lambda kb: (KINDS.index(kb[0]), kb[1]))]
