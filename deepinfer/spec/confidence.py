"""Survival estimates for drafted tokens: P(slot j is accepted | slots < j were), from the draft's own
confidence, calibrated online per slot position against the accepts observed.

Why calibrate: a draft's probability of its own token is informative but not a probability of
acceptance (the MTP head is over- or under-confident depending on the slot and the text). Per slot
position j the calibrator keeps accept / trial counts in confidence bins and answers with the
isotonic (pool-adjacent-violators) fit of the binned rates, so the estimate is monotone in the
confidence and converges to the observed conditional acceptance. A prior pseudo-count per bin keeps
early estimates sane: at the bin's confidence shifted by the slot's observed offset (its accepts minus
its confidences, over its trials plus prior_weight x num_bins pseudo-trials at offset 0). So a slot whose
drafts are under-confident across the board is priced up in every bin after a few dozen observations,
not bin by bin: on the H200 (2026-12-04, 0e2f8a7) the embedded model's MTP drafts at one sequence had
mean confidence ~0.5-0.6 past slot 1 and were accepted 0.84-0.90 of the time, and with the prior at the
bins' centres the plan priced a chain of 5 at 2.97 expected tokens a step (static k = 5 ran tau 5.08)
and paused where k = 5 ran 1.78x.

Non-anticipating by construction: `estimate` reads only counts from outcomes already observed;
`observe` is called after a verification with that step's outcomes, and only for slots whose
predecessors were all accepted (the conditional event the estimate is of).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch


def isotonic_increasing(rates: list[float], weights: list[float]) -> list[float]:
    """Weighted least-squares non-decreasing fit of rates [M] (pool adjacent violators); M is small."""
    vals: list[float] = []
    wts: list[float] = []
    sizes: list[int] = []
    for r, w in zip(rates, weights):
        vals.append(r)
        wts.append(w)
        sizes.append(1)
        while len(vals) > 1 and vals[-2] > vals[-1]:
            w2 = wts[-2] + wts[-1]
            v2 = (vals[-2] * wts[-2] + vals[-1] * wts[-1]) / w2 if w2 > 0 else (vals[-2] + vals[-1]) / 2
            s2 = sizes[-2] + sizes[-1]
            vals[-2:], wts[-2:], sizes[-2:] = [v2], [w2], [s2]
    out: list[float] = []
    for v, s in zip(vals, sizes):
        out.extend([v] * s)
    return out


@dataclass
class SurvivalCalibrator:
    """num_slots positions x num_bins confidence bins of (accepts, trials)."""

    num_slots: int
    num_bins: int = 10
    prior_weight: float = 2.0
    # observations between isotonic refits (the fit is O(bins) per slot); early on, sooner: once the observations
    # since the last fit are an eighth of all seen (at one sequence an adaptive engine sees ~5 an MTP probe, 32 to
    # 1024 steps apart, and waiting for 64 kept the table at its prior for a whole H200 run, 2026-12-04)
    refit_every: int = 64
    refit_fraction: float = 0.125
    # and late, seldom: not before the observations since the last fit reach a tenth of all seen (at 64 sequences a
    # step brings ~320, and a refit each step cost ~0.2 ms of host time on this CPU for a table that barely moves;
    # at 2% (until 2026-12-05) a refit still ran every ~3 steps at 16 sequences, ~30 us a step of host time)
    refit_lag: float = 0.1
    _observed: int = field(init=False, default=0)
    # (slot, bin) -> (trials, accepts, sum of confidences) not yet counted
    _pending: dict = field(init=False, default_factory=dict)
    conf_sums: np.ndarray = field(init=False)  # [num_slots] observed confidences summed (the offset's)
    _centers: np.ndarray = field(init=False)  # [num_bins] each bin's centre (the prior before any offset)
    _rows: list = field(init=False, default_factory=list)  # the table as lists (survival's lookups)
    # numpy throughout (counts, fit, table): the refit runs every ~5 steps at 4 sequences, and with torch tensors
    # (scalar index updates, small ops) it cost ~0.15 ms a refit of host time on this CPU (2026-12-04)
    accepts: np.ndarray = field(init=False)
    trials: np.ndarray = field(init=False)
    table: np.ndarray = field(init=False)  # [num_slots, num_bins] fitted survival (fp64)
    _since_fit: int = field(init=False, default=0)
    # (slots, confidences, accepted) arrays not yet counted: `_add` only appends, the refit counts them all at once
    # (the counts are read by the refit only; three bincounts a step cost ~50 us of host time at 256 sequences)
    _pending_arrays: list = field(init=False, default_factory=list)
    # (confidences, reached, accepted) lists per verification not yet counted (`observe_verified`)
    _pending_rows: list = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        centers = (np.arange(self.num_bins, dtype=np.float64) + 0.5) / self.num_bins
        self.accepts = np.tile(centers, (self.num_slots, 1)) * self.prior_weight
        self.trials = np.full((self.num_slots, self.num_bins), self.prior_weight, dtype=np.float64)
        self.conf_sums = np.zeros(self.num_slots)
        self._centers = centers
        self._refit()

    @property
    def num_observed(self) -> int:
        """Outcomes counted (engine life)."""
        return self._observed

    def survival(self, slot: int, conf: float) -> float:
        """`estimate` for one (slot, confidence) in plain floats (the per-step host path)."""
        return self._rows[min(max(int(slot), 0), self.num_slots - 1)][self._bin(conf)]

    def survival_row(self, conf: list[float], n: int) -> list[float]:
        """`survival` of a draft's first n slots (slot j at conf[j]): one comprehension, the same lookups (the
        per-step host path of a few sequences: ~1 us a slot where `survival` calls took ~3.5 on this CPU)."""
        rows, nb, last = self._rows, self.num_bins, self.num_slots - 1
        top = nb - 1
        # (a conditional, not min(): this runs per slot per step)
        return [rows[j if j < last else last][min(max(int(c * nb), 0), top)] for j, c in zip(range(n), conf)]  # noqa: FURB136

    def _bin(self, conf: float) -> int:
        """`_bins` for one plain float (the same clamp, scale and truncation)."""
        return min(int(min(max(float(conf), 0.0), 1.0) * self.num_bins), self.num_bins - 1)

    def observe_lists(self, slots: list[int], conf: list[float], accepted: list[float]) -> None:
        """`observe` from plain lists: a few slots (a step at low concurrency) wait in a dict until the refit (no
        array ops); more go straight to the counts (numpy bincounts beat that loop above ~64 on this CPU)."""
        if not slots:
            return
        if len(slots) > 64:
            self._add(np.asarray(slots, dtype=np.int64), np.asarray(conf, dtype=np.float64),
                      np.asarray(accepted, dtype=np.float64))
            return
        pending = self._pending
        for s, c, a in zip(slots, conf, accepted):
            key = (min(max(int(s), 0), self.num_slots - 1), self._bin(c))
            n, acc, cs = pending.get(key, (0, 0.0, 0.0))
            pending[key] = (n + 1, acc + float(a), cs + min(max(float(c), 0.0), 1.0))
        self._counted(len(slots))

    def observe_verified(self, conf: list[list[float]], verified: list[int], accepted: list[int]) -> None:
        """One verification's outcomes, request by request: request i verified verified[i] drafts whose confidences
        lead conf[i], and accepted accepted[i] of them; slot j is an outcome where every slot before it was accepted
        (j <= accepted[i]), accepted where j < accepted[i]. Kept as given until the next refit (`_flush_rows`), which
        counts every verification since the last one in one [rows, W] array: per verification that array (or, for
        a few outcomes, the per-slot loop of `observe_lists`) cost ~70-80 us of host time a step at 16-64 sequences
        on this CPU (2026-12-05, benchmarks/spec_host.py), the largest part of the adaptive mode's deferred work."""
        reached = [v if v <= a else a + 1 for v, a in zip(verified, accepted)]
        n = sum(reached)
        if n:
            self._pending_rows.append((conf, reached, accepted))
            self._counted(n)

    def _flush_rows(self) -> None:
        """Count the verifications `observe_verified` kept: slots 0 .. reached - 1 of a row are its outcomes, slot j
        accepted where j < accepted (flat arrays over all of them: the rows' lengths differ, and a padded matrix of
        them cost twice as much here)."""
        if not self._pending_rows:
            return
        conf, reached, accepted = [], [], []
        for c, r, a in self._pending_rows:
            conf += c
            reached += r
            accepted += a
        self._pending_rows.clear()
        if any(len(row) < n for row, n in zip(conf, reached)):  # (a row shorter than its outcomes: zeros past it)
            conf = [row + [0.0] * (n - len(row)) for row, n in zip(conf, reached)]
        c = np.fromiter(chain.from_iterable(row[:n] for row, n in zip(conf, reached)), dtype=np.float64)
        r = np.asarray(reached, dtype=np.int64)
        start = np.repeat(np.cumsum(r) - r, r)  # each outcome's row start in the flat arrays
        slots = np.arange(c.size, dtype=np.int64) - start
        acc = (slots < np.repeat(np.asarray(accepted, dtype=np.int64), r)).astype(np.float64)
        self._pending_arrays.append((slots, c, acc))

    def _add(self, slots: np.ndarray, conf: np.ndarray, accepted: np.ndarray) -> None:
        """Add outcomes (flat arrays) to the counts, at the next refit (`_flush`)."""
        self._pending_arrays.append((slots, conf, accepted))
        self._counted(int(slots.size))

    def _flush_arrays(self) -> None:
        """Count the arrays `_add` kept (numpy: its small ops cost a tenth of torch's on the host path)."""
        if not self._pending_arrays:
            return
        parts = self._pending_arrays
        slots, conf, accepted = parts[0] if len(parts) == 1 else (np.concatenate(p) for p in zip(*parts))
        self._pending_arrays = []
        nb, n, top = self.num_bins, self.num_slots * self.num_bins, self.num_slots - 1
        # (np.minimum / np.maximum: np.clip's values, NaN too, at a fraction of its cost on arrays this small; the
        # refit runs every few dozen steps in an engine's deferred work, ~240 us of host time there on this CPU)
        conf = np.minimum(np.maximum(conf, 0.0), 1.0)
        slots = np.minimum(np.maximum(slots, 0), top)
        flat = slots * nb + np.minimum((conf * nb).astype(np.int64), nb - 1)
        self.trials += np.bincount(flat, minlength=n).astype(np.float64).reshape(self.num_slots, nb)
        self.accepts += np.bincount(flat, weights=accepted, minlength=n).reshape(self.num_slots, nb)
        self.conf_sums += np.bincount(slots, weights=conf, minlength=self.num_slots)

    def _counted(self, n: int) -> None:
        self._since_fit += n
        self._observed += n
        if self._refit_due():
            self._refit()

    def _refit_due(self) -> bool:
        seen = self._observed
        return self._since_fit >= min(self.refit_fraction * seen, max(self.refit_every, self.refit_lag * seen))

    def _flush(self) -> None:
        """Add the pending observations (verifications, lists and arrays) to the counts."""
        self._flush_rows()
        self._flush_arrays()
        for (s, b), (n, acc, cs) in self._pending.items():
            self.trials[s, b] += n
            self.accepts[s, b] += acc
            self.conf_sums[s] += cs
        self._pending.clear()

    def _bins(self, conf: torch.Tensor) -> torch.Tensor:
        return (conf.to(torch.float64).clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)

    def estimate_array(self, conf: np.ndarray) -> np.ndarray:
        """fp64 survival of a [B, W] numpy array of confidences, column j at slot j (slots past the table: its last);
        in [0, 1] (the table is). The bins of `_bin`: conf x bins truncated toward zero, clamped to [0, bins - 1]
        after the truncation (the same bin as clamping conf first: np.clip on the floats cost ~10 us here)."""
        nb = self.num_bins
        bins = np.minimum(np.maximum((conf * nb).astype(np.int64), 0), nb - 1)
        slots = np.minimum(np.arange(conf.shape[1]), self.num_slots - 1)
        return self.table[slots[None, :], bins]

    def estimate(self, slots: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """fp64 survival per (slot index, confidence) pair (same shapes; slots clamped to the table)."""
        s = slots.to(torch.int64).clamp(0, self.num_slots - 1)
        return torch.from_numpy(self.table)[s.cpu(), self._bins(conf).cpu()].to(conf.device)

    def observe(self, slots: torch.Tensor, conf: torch.Tensor, accepted: torch.Tensor) -> None:
        """Record outcomes of verified slots whose predecessors were all accepted (flat tensors)."""
        if slots.numel() == 0:
            return
        self._add(slots.to(torch.int64).cpu().numpy(), conf.to(torch.float64).cpu().numpy(),
                  accepted.to(torch.float64).cpu().numpy())

    def _refit(self) -> None:
        self._flush()
        w = self.prior_weight
        obs_acc = self.accepts - self._centers * w  # the observed counts (the prior at the centres taken out)
        n = (self.trials - w).sum(1)
        offset = (obs_acc.sum(1) - self.conf_sums) / (n + w * self.num_bins)
        prior = np.minimum(np.maximum(self._centers[None, :] + offset[:, None], 0.01), 0.99)
        rates = ((obs_acc + w * prior) / self.trials).tolist()
        weights = self.trials.tolist()
        # (clamped to [0, 1], as survival is: a rate past 1 by rounding would be priced above certain)
        self._rows = [[min(max(x, 0.0), 1.0) for x in isotonic_increasing(rates[j], weights[j])]
                      for j in range(self.num_slots)]
        self.table = np.array(self._rows, dtype=np.float64)
        self._since_fit = 0

    def conditional_acceptance(self) -> list[float]:
        """Observed (prior-free) acceptance per slot position, NaN where nothing was observed."""
        self._flush()
        prior_trials = self.prior_weight * self.num_bins
        prior_acc = self.prior_weight * self.num_bins * 0.5
        t = (self.trials.sum(1) - prior_trials).tolist()
        a = (self.accepts.sum(1) - prior_acc).tolist()
        return [x / y if y > 0 else float("nan") for x, y in zip(a, t)]


def conf_matrix(rows: list[list[float]], width: int) -> np.ndarray:
    """[len(rows), width] fp64 of each row's first width entries (rows shorter than width: zeros after them)."""
    if width and rows and len(rows[0]) == width:
        try:  # the usual step: every row as long (one array call; a ragged list raises)
            out = np.array(rows, dtype=np.float64)
            if out.ndim == 2:
                return out
        except ValueError:
            pass
    return np.array([r[:width] + [0.0] * (width - len(r[:width])) for r in rows],
                    dtype=np.float64).reshape(len(rows), width)
