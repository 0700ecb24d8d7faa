"""An adaptive SlotPolicy over made-up calibration and cost tables, planning by the model from its first plan
(tests/spec/test_spec_cost_model.py, tests/spec/test_spec_realized_rates.py)."""

from __future__ import annotations

import torch

from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.draft_cost import DraftCostTable
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.slot_policy import SlotPolicy


def chain_policy(accept: list[float], one: float, full: float, k: int = 5, step: float = 0.04, **fields) -> SlotPolicy:
    """An adaptive policy whose calibrator has seen slot j accepted at rate accept[j] (at confidence 0.9, the
    drafts' mean confidence), a flat step cost (verified tokens almost free) and drafting that costs `one` for a
    chain of 1, `full` for k, at any load. It plans by the model from its first plan (measure_steps 0: the measuring
    plans have tests of their own), at every step (replan_every 1, not growing: the plan's hold has a test of its own), pausing
    where drafting falls below plain decoding at all (pause_margin 0) and pricing every slot (admit_all_below 0: the
    margin and the nearly-free admission have tests of their own); `fields` override any SlotPolicy field."""
    cal = SurvivalCalibrator(num_slots=k)
    for j, rate in enumerate(accept):
        n = 1000
        cal.observe(torch.full((n,), j), torch.full((n,), 0.9, dtype=torch.float64),
                    (torch.arange(n) < rate * n).to(torch.float64))
    drafts = DraftCostTable(k, StepCostTable([1, 64], [one, one]), StepCostTable([1, 64], [full, full]))
    settings = {"k": k, "max_model_len": 4096, "calibrator": cal, "draft_cost": drafts, "probe": False,
                "cost": StepCostTable([1, 4096], [step, step * 1.01]), "mean_confidence": [0.9] * k,
                "measure_steps": 0, "replan_every": 1, "max_replan_every": 1, "pause_margin": 0.0,
                "admit_all_below": 0.0}
    return SlotPolicy(**{**settings, **fields})
