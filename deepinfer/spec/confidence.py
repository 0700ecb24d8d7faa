"""Survival estimates for drafted tokens: P(slot j is accepted | slots < j were), from the draft's own
confidence, calibrated online per slot position against the accepts observed.

Why calibrate: a draft's probability of its own token is informative but not a probability of
acceptance (the MTP head is over- or under-confident depending on the slot and the text). Per slot
position j the calibrator keeps accept / trial counts in confidence bins and answers with the
isotonic (pool-adjacent-violators) fit of the binned rates, so the estimate is monotone in the
confidence and converges to the observed conditional acceptance. A prior pseudo-count at the
bin's own confidence keeps early estimates sane.

Non-anticipating by construction: `estimate` reads only counts from outcomes already observed;
`observe` is called after a verification with that step's outcomes, and only for slots whose
predecessors were all accepted (the conditional event the estimate is of).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def isotonic_increasing(rates: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted least-squares non-decreasing fit of rates [M] (pool adjacent violators); M is small."""
    vals: list[float] = []
    wts: list[float] = []
    sizes: list[int] = []
    for r, w in zip(rates.tolist(), weights.tolist()):
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
    return torch.tensor(out, dtype=torch.float64)


@dataclass
class SurvivalCalibrator:
    """num_slots positions x num_bins confidence bins of (accepts, trials)."""

    num_slots: int
    num_bins: int = 10
    prior_weight: float = 2.0
    refit_every: int = 64  # observations between isotonic refits (the fit is O(bins) per slot)
    accepts: torch.Tensor = field(init=False)
    trials: torch.Tensor = field(init=False)
    table: torch.Tensor = field(init=False)  # [num_slots, num_bins] fitted survival
    _since_fit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        centers = (torch.arange(self.num_bins, dtype=torch.float64) + 0.5) / self.num_bins
        self.accepts = centers.repeat(self.num_slots, 1) * self.prior_weight
        self.trials = torch.full((self.num_slots, self.num_bins), self.prior_weight, dtype=torch.float64)
        self._refit()

    def _bins(self, conf: torch.Tensor) -> torch.Tensor:
        return (conf.to(torch.float64).clamp(0, 1) * self.num_bins).long().clamp(max=self.num_bins - 1)

    def estimate(self, slots: torch.Tensor, conf: torch.Tensor) -> torch.Tensor:
        """fp64 survival per (slot index, confidence) pair (same shapes; slots clamped to the table)."""
        s = slots.to(torch.int64).clamp(0, self.num_slots - 1)
        return self.table[s.cpu(), self._bins(conf).cpu()].to(conf.device)

    def observe(self, slots: torch.Tensor, conf: torch.Tensor, accepted: torch.Tensor) -> None:
        """Record outcomes of verified slots whose predecessors were all accepted (flat tensors)."""
        if slots.numel() == 0:
            return
        s = slots.to(torch.int64).clamp(0, self.num_slots - 1).cpu()
        b = self._bins(conf).cpu()
        flat = s * self.num_bins + b
        n = self.num_slots * self.num_bins
        self.trials += torch.bincount(flat, minlength=n).view(self.num_slots, self.num_bins).to(torch.float64)
        self.accepts += torch.bincount(flat, weights=accepted.to(torch.float64).cpu(), minlength=n).view(
            self.num_slots, self.num_bins)
        self._since_fit += int(slots.numel())
        if self._since_fit >= self.refit_every:
            self._refit()

    def _refit(self) -> None:
        rates = self.accepts / self.trials
        self.table = torch.stack([isotonic_increasing(rates[j], self.trials[j]) for j in range(self.num_slots)])
        self._since_fit = 0

    def conditional_acceptance(self) -> list[float]:
        """Observed (prior-free) acceptance per slot position, NaN where nothing was observed."""
        prior_trials = self.prior_weight * self.num_bins
        prior_acc = self.prior_weight * self.num_bins * 0.5
        t = self.trials.sum(1) - prior_trials
        a = self.accepts.sum(1) - prior_acc
        return [float(x) / float(y) if y > 0 else float("nan") for x, y in zip(a, t)]
