"""Shared fixtures of the speculative-decoding tests."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.models.registry import load_model
from deepinfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def parts():
    """(path, cpu backend, model, tokenizer) of the embedded stdlib-coder with its MTP module, fp32, loaded once:
    engines are built around it with DeepInferenceEngine.from_components (nothing here changes the model)."""
    path = deepinfer.embedded_model_path()
    backend = CPUBackend()
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    return path, backend, model, Tokenizer.from_pretrained(path)


@pytest.fixture
def unprofiled(monkeypatch):
    """For a test that replaces its adaptive engines' cost tables (policy.cost and policy.draft_cost, or sets
    draft_cost None) right after building them, before any step: the start-up profiles (spec/cost_profile.py,
    spec/draft_cost.py: timed forwards and drafting chains, most of such an engine's build under the Triton
    interpreter) return flat placeholder tables instead, which the test then replaces. The profiles themselves are
    checked in test_spec_cost_model.py."""
    from deepinfer.spec import cost_profile, draft_cost
    from deepinfer.spec.scheduler import StepCostTable

    def flat() -> StepCostTable:
        return StepCostTable([1, 2], [1.0, 1.0])

    monkeypatch.setattr(cost_profile, "profile_step_costs", lambda *a, **kw: (flat(), ["unprofiled"] * 2))
    monkeypatch.setattr(draft_cost, "profile_draft_costs",
                        lambda model, backend, block_size, k, *a, **kw: draft_cost.DraftCostTable(
                            k, flat(), flat(), ["unprofiled"] * 2))
