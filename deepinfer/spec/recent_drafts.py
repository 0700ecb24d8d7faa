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

from deepinfer.spec.confidence import SurvivalCalibrator, conf_matrix


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

    def _stacked(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """[N, k] confidences of the kept drafts (zeros past a draft's width) and [N, k] whether each slot is held."""
        confs, helds = [], []
        for conf, lens in self._rows:
            m = conf[:, :k] if isinstance(conf, np.ndarray) else conf_matrix(conf, k)
            if m.shape[1] < k:
                m = np.pad(m, ((0, 0), (0, k - m.shape[1])))
            confs.append(m)
            helds.append(np.arange(k)[None, :] < np.asarray(lens)[:, None])
        if not confs:
            return np.empty((0, k)), np.empty((0, k), dtype=bool)
        return np.concatenate(confs), np.concatenate(helds)

    def expected_reach(self, calibrator: SurvivalCalibrator, k: int, fallback: list[float]) -> list[float] | None:
        """Mean over the kept drafts of the probability that their first l slots all survive, l = 1..k, under the
        calibrator's table (`estimate_array`); a slot a draft does not hold at fallback[j]. None while no draft is
        kept."""
        conf, held = self._stacked(k)
        if conf.shape[0] == 0:
            return None
        surv = np.where(held, calibrator.estimate_array(conf), np.asarray(fallback, dtype=np.float64)[None, :k])
        return np.cumprod(surv, axis=1).mean(axis=0).tolist()
