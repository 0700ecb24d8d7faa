"""The confidence scheduler: how many drafted tokens of each request to verify this step.

Each candidate slot (request i, slot j) has a survival estimate s_ij (confidence.py); its expected
contribution is the probability that it is reached and accepted, S_ij = s_i1 * ... * s_ij. A step
that verifies n slots on top of its base tokens (one per decoding request, plus prefill chunks)
yields E(n) = B + sum of the admitted S_ij tokens and takes cost(base + n) seconds (a step-cost table
profiled at start-up, `StepCostTable`), so its expected throughput is E(n) / (draft + cost(base + n)).
Slots are admitted greedily by S (never a slot before its predecessor: S is non-increasing along a
request) and the prefix with the best expected throughput is kept: with spare compute (low load) that
verifies deep drafts, under load it shrinks the budget towards zero, so speculation never costs
throughput by the model of the cost.

Non-anticipating: the admission reads confidences and calibration counts only, never the draw that
decides acceptance, so whatever is admitted, every emitted token keeps the target distribution
(tests/spec/test_scheduler_lossless.py shows a rule that peeks biasing (0.7, 0.3) to (0.85, 0.15)).
For random (non-greedy) drafts the confidence must not depend on the token drawn, only on q.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepCostTable:
    """Seconds per step at a batch token count: piecewise linear between profiled points, linear beyond."""

    tokens: list[int]
    seconds: list[float]
    # `at`'s answers by token count (the policy asks the same few counts every step: ~25 lookups a step at one
    # sequence, half its host time on this CPU, 2026-12-04); emptied when `seconds` is replaced
    _memo: dict[float, float] = field(default_factory=dict, init=False, repr=False, compare=False)
    _memo_of: list | None = field(default=None, init=False, repr=False, compare=False)
    _arrays: tuple = field(default=(), init=False, repr=False, compare=False)  # cost_array's x, y, end slopes
    _arrays_of: list | None = field(default=None, init=False, repr=False, compare=False)
    # cost_range's answers by (first token count, length): a steady load asks the same range every step
    _ranges: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _ranges_of: list | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or sorted(self.tokens) != list(self.tokens) or len(set(self.tokens)) != len(self.tokens):
            raise ValueError(f"StepCostTable needs >= 2 increasing token counts, got {self.tokens}")
        if len(self.seconds) != len(self.tokens) or any(s <= 0 for s in self.seconds):
            raise ValueError("StepCostTable needs one positive time per token count")
        # a cost that falls with more tokens is timing noise, and timing noise only slows a run: make the table
        # non-decreasing by lowering a point to the cheapest point after it (a suffix minimum), not by raising the
        # points after it to it. On the H100 (2026-12-05, c2c17e1) the drafting table's chain of 5 timed 2.11 ms at
        # 4 sequences against 0.62 ms at 2, and the running maximum priced every load from 4 to 128 sequences at
        # 2.11 ms: the plan then put plain decoding ahead of every chain at 4-64 sequences, drafted chains of 1,
        # and the adaptive mode ran 0.75-1.08x of speculation off where static k = 3 / 5 ran 1.10-1.20x.
        secs, low = [], float("inf")
        for s in reversed(self.seconds):
            low = min(low, s)
            secs.append(low)
        self.seconds = secs[::-1]

    def at(self, num_tokens: float) -> float:
        """Seconds at one token count (the same interpolation as `cost`, in plain floats: the per-step host path)."""
        if self._memo_of is not self.seconds or len(self._memo) > 4096:
            self._memo, self._memo_of = {}, self.seconds
        got = self._memo.get(num_tokens)
        if got is None:
            got = self._memo[num_tokens] = self._interpolate(float(num_tokens))
        return got

    def _interpolate(self, t: float) -> float:
        """np.interp's arithmetic (slope x (t - x_j) + y_j, y_j at a knot), so that `at` and `cost_array` give the
        same floats (the two admission paths compare rates); linear beyond the ends, by the end segments."""
        xs, ys = self.tokens, self.seconds
        if t == xs[-1]:
            return ys[-1]
        j = min(max(bisect.bisect_right(xs, t) - 1, 0), len(xs) - 2)
        if t == xs[j]:
            return ys[j]
        return (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (t - xs[j]) + ys[j]

    def cost(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """fp64 seconds for each token count in num_tokens (any shape)."""
        return torch.from_numpy(np.asarray(self.cost_array(num_tokens.to(torch.float64).cpu().numpy())))

    def cost_range(self, first: int, count: int) -> np.ndarray:
        """cost_array of first, first + 1, ..., first + count - 1 (read-only, shared: copy before writing). Memoised:
        at a steady load the admission prices the same range every step (~18 us of its ~120 a step at 16 sequences
        on this CPU, 2026-12-05)."""
        if self._ranges_of is not self.seconds or len(self._ranges) > 256:
            self._ranges, self._ranges_of = {}, self.seconds
        got = self._ranges.get((first, count))
        if got is None:
            got = self.cost_array(first + np.arange(count, dtype=np.float64))
            got.flags.writeable = False
            self._ranges[(first, count)] = got
        return got

    def cost_array(self, t: np.ndarray) -> np.ndarray:
        """fp64 seconds for each token count of a numpy array (`at`, vectorised: np.interp inside the table, the end
        segments' lines beyond it; ~4 us at 80 counts where a searchsorted form took ~15 on this CPU)."""
        if self._arrays_of is not self.seconds:  # (the table's arrays, made again when `seconds` is replaced)
            x, y = np.asarray(self.tokens, dtype=np.float64), np.asarray(self.seconds, dtype=np.float64)
            self._arrays, self._arrays_of = (x, y, (y[1] - y[0]) / (x[1] - x[0]), (y[-1] - y[-2]) / (x[-1] - x[-2])), \
                self.seconds
        x, y, first, last = self._arrays
        t = np.asarray(t, dtype=np.float64)
        out = np.asarray(np.interp(t, x, y))  # (an array for a 0-d t too: np.interp gives a scalar there)
        if t.size and t.max() > x[-1]:
            hi = t > x[-1]
            out[hi] = last * (t[hi] - x[-2]) + y[-2]
        if t.size and t.min() < x[0]:
            lo = t < x[0]
            out[lo] = first * (t[lo] - x[0]) + y[0]
        return out


@dataclass
class Admission:
    """Slots admitted per request, and the model's view of the step (for metrics)."""

    num_slots: torch.Tensor  # int64 [B]
    expected_tokens: float
    expected_seconds: float


def admit(survival: torch.Tensor, draft_lens: torch.Tensor, cost: StepCostTable, base_tokens: int,
          base_yield: float, draft_seconds: float = 0.0, speculation_seconds: float = 0.0) -> Admission:
    """survival [B, K] conditional survival per slot (entries past draft_lens ignored); base_tokens:
    tokens the step runs anyway; base_yield: tokens it yields anyway (one per decoding request);
    draft_seconds: drafting time every choice pays; speculation_seconds: time paid only when some slot is
    admitted (drafting that stops when speculation does not pay: the engine's adaptive mode)."""
    counts, expected, seconds = admit_array(survival.cpu().to(torch.float64).numpy(), draft_lens.cpu().numpy(), cost,
                                            base_tokens, base_yield, draft_seconds, speculation_seconds)
    return Admission(torch.from_numpy(counts), expected, seconds)


def admit_array(survival: np.ndarray, lens: np.ndarray, cost: StepCostTable, base_tokens: int, base_yield: float,
                draft_seconds: float = 0.0, speculation_seconds: float = 0.0,
                in_unit: bool = False, all_within: float = 0.0) -> tuple[np.ndarray, float, float]:
    """`admit` on numpy arrays (the per-step host path at many slots: SlotPolicy.counts): survival [B, K] fp64,
    lens [B]; returns (int64 counts [B], expected tokens, seconds). in_unit: the caller's survival is within [0, 1]
    already (the calibrator's table is), so the clamp is skipped (it would change nothing). all_within: every slot is
    admitted where that rate is at least (1 - all_within) of the best prefix's (0: the best prefix only)."""
    b, k = survival.shape
    if b == 0 or k == 0:
        return np.zeros(b, dtype=np.int64), base_yield, cost.at(base_tokens) + draft_seconds
    # numpy, not torch, and few calls: each small numpy call costs ~2-5 us of host time on this CPU (np.clip ~10,
    # np.lexsort ~12 at 80 slots), torch's ~10x that; 2026-12-04: ~30 calls, ~130 us at 16 sequences x 5 slots.
    # Every draft held in full (the usual step): no validity mask to apply.
    lens = np.asarray(lens)
    full = int(lens.min()) >= k
    valid = None if full else np.arange(k) < lens[:, None]
    reach = survival if in_unit else np.minimum(np.maximum(survival, 0.0), 1.0)
    # reach along each row (non-increasing), laid out slot-major (index j * b + i): a stable sort by reach
    # descending then breaks ties by slot index, then request (keeps every request's admitted slots a prefix)
    flat = np.cumprod(reach if full else np.where(valid, reach, 0.0), axis=1).T.reshape(-1)
    order = np.argsort(-flat, kind="stable")
    if not full:
        order = order[valid.T.reshape(-1)[order]]
    # base + (running sum of the gains): admit_lists' association, so both paths compare the same floats
    expected = np.empty(order.size + 1)
    expected[0] = 0.0
    np.cumsum(flat[order], out=expected[1:])
    expected += base_yield
    seconds = cost.cost_range(base_tokens, order.size + 1) + draft_seconds
    seconds[1:] += speculation_seconds
    rates = expected / seconds
    best = int(np.argmax(rates))  # first maximum: the fewest slots for the best rate
    if all_within > 0.0 and rates[-1] >= (1.0 - all_within) * rates[best]:
        best = order.size
    counts = np.bincount(order[:best] % b, minlength=b)
    return counts.astype(np.int64), float(expected[best]), float(seconds[best])


def admit_lists(survival: list[list[float]], cost: StepCostTable, base_tokens: int, base_yield: float,
                speculation_seconds: float = 0.0, draft_seconds: float = 0.0, all_within: float = 0.0) -> list[int]:
    """`admit` in plain floats for a few slots (the per-step host path at low concurrency, where the tensor version's
    ~20 small ops cost ~0.5 ms of host time a step on this CPU): survival[i] holds request i's conditional
    survival per slot (its draft's length); draft_seconds: time every choice pays (admit's). The same order
    (reach descending, ties by slot index, then request), the same fp64 arithmetic and the same first maximum,
    so the same counts (tests/spec/test_scheduler_lossless.py compares them); all_within: admit_array's."""
    items: list[tuple[float, int, int]] = []
    for i, row in enumerate(survival):
        reach = 1.0
        for j, x in enumerate(row):
            reach *= min(max(x, 0.0), 1.0)
            items.append((-reach, j, i))
    if len(survival) > 1:  # (one request: its reach never rises along the row, so slot order is the order)
        items.sort()
    best, gained = 0, 0.0
    best_rate = rate = float(base_yield) / (cost.at(base_tokens) + draft_seconds)
    for n, (neg, _, _) in enumerate(items, 1):
        gained += -neg  # as admit's cumsum, then added to the base yield
        rate = (base_yield + gained) / (cost.at(base_tokens + n) + draft_seconds + speculation_seconds)
        if rate > best_rate:
            best, best_rate = n, rate
    if all_within > 0.0 and rate >= (1.0 - all_within) * best_rate:  # (rate: every slot's, the last one)
        best = len(items)
    counts = [0] * len(survival)
    for _, _, i in items[:best]:
        counts[i] += 1
    return counts

