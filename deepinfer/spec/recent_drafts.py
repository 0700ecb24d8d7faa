"""The chain model's expected reach from the recent drafts' own confidences (SlotPolicy.recent_drafts; off: None).

What the plan prices a chain of l drafts at is the tokens it expects a sequence to emit, 1 + sum over m <= l of the
probability that the first m drafts all survive. The default model (spec/chain_plan.py `chain_model`) takes that as
the product of each slot's calibrated survival at the slot's mean confidence, s_j(mean c_j). Where survival is not
linear in the confidence that is biased (Jensen's inequality): on drafts that are nearly always accepted above some
confidence and mostly rejected below it, the survival at the mean confidence is the upper plateau, while the mean
survival is the plateau weighted down by the low-confidence drafts. On an H100 (session 43, the v2-lite-mtp-bench
checkpoint, drafts accepted ~0.85 a slot) the model put chains of 1 / 2 / 3 at 2.0 / 3.0 / 4.0 tokens a step at one
sequence where static k1 and k3 emitted 1.85 and 3.23, and its plans kept returning to chains that its realized
rates then paused; how much of that over-promise was this bias was not measured (that run kept no confidences).

This keeps the confidences of the drafts held at the last `steps` priced admissions (the steps where the mean
confidence is updated: `SlotAdmission.counts`), references only, and at plan time answers the mean over those
drafts of prod_{j < l} s_j(c_j): the expected reach under the calibration of the drafts as they come, the slots'
correlation within a draft included. A slot past a draft's held length (a chain shorter than the one priced) is at
the default model's s_j(mean c_j). Non-anticipating: past drafts' confidences and past outcomes' calibration only.

Off by default (SlotPolicy.recent_drafts None): in the closed-loop model (benchmarks/spec_policy_sim.py, models
h100v8-b1 / b4 / b16, fitted to that H100 run with acceptance a step in the confidence, 6 seeds, `--max-tokens 256
--repeats 3 --warm-up 16 --host-factor 0`) the adaptive mode ran 1.002 / 1.002 / 1.009 of the best static with it
(`--policy recent_drafts=32`) against 1.003 / 1.000 / 1.009 without: the plans differ (it paused 840 steps at one
sequence against 92) and the throughput does not, the realized rates deciding once measured. Not run on a GPU.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RecentDrafts:
    """The held drafts' confidences of the last `steps` priced admissions."""

    steps: int = 32
    _rows: deque = field(init=False)  # (confidences [B][>= len], held lengths [B]) as the admission had them

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"RecentDrafts needs steps >= 1, got {self.steps}")
        self._rows = deque(maxlen=self.steps)

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, conf, lens) -> None:
        """One admission's drafts: conf a list of confidence lists or a [B, W] array, lens each draft's held slots."""
        self._rows.append((conf, lens))

    def matrix(self, k: int) -> np.ndarray:
        """[N, k] confidences of the kept drafts, NaN past each one's held length."""
        out = []
        for conf, lens in self._rows:
            if isinstance(conf, np.ndarray):
                w = min(conf.shape[1], k)
                m = np.full((conf.shape[0], k), np.nan)
                held = np.arange(w)[None, :] < np.asarray(lens)[:, None]
                m[:, :w] = np.where(held, conf[:, :w], np.nan)
                out.append(m)
                continue
            m = np.full((len(conf), k), np.nan)
            for i, (c, n) in enumerate(zip(conf, lens)):
                n = min(n, k)
                m[i, :n] = c[:n]
            out.append(m)
        return np.concatenate(out) if out else np.empty((0, k))

    def expected_reach(self, table: np.ndarray, k: int, fallback: list[float]) -> list[float] | None:
        """Mean over the kept drafts of the probability that their first l slots all survive, l = 1..k, under the
        calibrated table [slots, bins] (a slot past the table's last row at its last row's); a slot a draft does not
        hold at fallback[j]. None while no draft is kept."""
        conf = self.matrix(k)
        if conf.shape[0] == 0:
            return None
        slots, bins = table.shape
        missing = np.isnan(conf)
        b = np.clip((np.nan_to_num(conf) * bins).astype(np.int64), 0, bins - 1)
        rows = np.minimum(np.arange(k), slots - 1)
        surv = table[rows[None, :], b]
        surv = np.where(missing, np.asarray(fallback, dtype=np.float64)[None, :k], surv)
        reach = np.cumprod(np.clip(surv, 0.0, 1.0), axis=1).mean(axis=0)
        return reach.tolist()
