"""The adaptive scheduler's cost model on the cpu backend (spec/cost_profile.py, spec/draft_cost.py): profiled in
the form the engine runs, over tokens that route like real ones, and the drafting cost at the step's load."""

from __future__ import annotations

import pytest
import torch

import deepinfer
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.models.registry import load_model
from deepinfer.spec.confidence import SurvivalCalibrator
from deepinfer.spec.cost_profile import profile_step_costs
from deepinfer.spec.draft_cost import profile_draft_costs
from deepinfer.spec.draft_slots import HeldDraft, SlotPolicy
from deepinfer.spec.scheduler import StepCostTable


class SpyModel:
    """Delegates to a real model and records what its forward and MTP forward ran (what a profile timed)."""

    def __init__(self, model):
        self.model, self.batches, self.mtp_batches = model, [], []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, batch, caches):
        self.batches.append(batch)
        return self.model.forward(batch, caches)

    def mtp_forward(self, hidden, next_ids, batch, caches, k: int = 0):
        self.mtp_batches.append(batch)
        return self.model.mtp_forward(hidden, next_ids, batch, caches, k)


@pytest.fixture(scope="module")
def cpu_model():
    backend = CPUBackend()
    return backend, load_model(deepinfer.embedded_model_path(), backend, torch.float32, progress=False, load_mtp=True)


def test_eager_step_costs_are_timed_in_the_form_the_engine_runs_verify_steps(cpu_model):
    """The cpu backend runs an eager verify step as decode rows (decode_rows_eager); its step costs must be timed
    that way, not as varlen prefill sequences (the MLA op's per-request prefill path, which the engine no longer
    takes there), and over different token ids: one repeated id routes every token to the same experts, and the
    table then prices extra verified tokens at almost nothing (2.5x under at 16 tokens with the embedded model)."""
    backend, model = cpu_model
    spy = SpyModel(model)
    table, shapes = profile_step_costs(spy, backend, 16, 3, 8, repeats=1, decode_rows=True)
    assert table.tokens == [1, 2, 4, 8] and shapes == ["decode rows"] * 4
    assert all(b.is_decode_only for b in spy.batches) and [b.num_seqs for b in spy.batches] == [1, 2, 4, 8]
    last = spy.batches[-1]  # two verify rows of 1 + k = 4 tokens each, one decode row per token, every row's logits
    assert last.positions.tolist() == [0, 1, 2, 3] * 2 and last.seq_lens_cpu == [1, 2, 3, 4] * 2
    assert last.logits_indices.tolist() == list(range(8)) and last.slot_mapping["mla"].unique().numel() == 8
    assert last.input_ids.unique().numel() > 4
    spy.batches.clear()
    _, shapes = profile_step_costs(spy, backend, 16, 3, 8, repeats=1)
    assert shapes == ["varlen"] * 4 and not spy.batches[-1].is_decode_only  # backends without decode_rows_eager
    assert spy.batches[-1].query_lens_cpu == [4, 4] and spy.batches[-1].input_ids.unique().numel() > 4


def test_the_cpu_engine_profiles_its_costs_as_it_runs_them(cpu_model):
    """Wiring: an adaptive mtp engine on the cpu backend runs verify steps as decode rows, its step-cost table was
    profiled in that form, and it holds a drafting-cost table by sequences (spec/setup.py)."""
    from deepinfer import EngineConfig
    from deepinfer.engine import DeepInferenceEngine
    from deepinfer.text.tokenizer import Tokenizer

    backend, model = cpu_model
    path = deepinfer.embedded_model_path()
    cfg = EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=64,
                       max_num_batched_tokens=64, max_num_seqs=4, load_progress=False, speculative_method="mtp",
                       num_speculative_tokens=3, speculative_adaptive=True)
    engine = DeepInferenceEngine.from_components(cfg, model, Tokenizer.from_pretrained(path), backend)
    policy = engine._spec.policy
    assert engine._spec.decode_rows_eager
    assert policy.cost.tokens[-1] == 64 and policy.cost_shapes == ["decode rows"] * 7
    assert policy.draft_cost is not None and policy.draft_cost.tokens == [1, 2, 4]


def test_drafting_cost_is_the_drafters_own_pass_and_chain_timed_by_sequences(cpu_model):
    """profile_draft_costs times MTPDrafter.run itself: per point one pass over every sequence's verified rows
    (1 + k // 2 each) and k - 1 chain links of one row per sequence."""
    backend, model = cpu_model
    spy = SpyModel(model)
    table = profile_draft_costs(spy, backend, 16, 3, 4, repeats=1)
    assert table.tokens == [1, 2, 4] and all(s > 0 for s in table.seconds)
    assert [b.num_tokens for b in spy.mtp_batches] == [2, 1, 1, 4, 2, 2, 8, 4, 4]
    assert spy.mtp_batches[-1].positions.tolist() == [3, 3, 3, 3]  # the last link: one position past the pass + 1


def held(n: int) -> list[HeldDraft]:
    return [HeldDraft(seq=None, num_tokens=0, tokens=[1, 2, 3], confidence=[0.95, 0.95, 0.95]) for _ in range(n)]


def test_admission_charges_the_drafting_cost_of_this_steps_sequences():
    """A flat step cost (verified tokens nearly free) and drafts accepted 95% of the time: drafting pays where it
    is cheap (1 sequence: 10 ms) and not where it is not (64 sequences: 10 s). A single moving-average drafting
    time (draft_seconds, here measured at 1 sequence) would admit both."""
    cal = SurvivalCalibrator(num_slots=3)
    cal.observe(torch.tensor([0, 1, 2] * 200), torch.full((600,), 0.95, dtype=torch.float64), torch.ones(600))
    policy = SlotPolicy(k=3, max_model_len=512, calibrator=cal, cost=StepCostTable([1, 4096], [0.1, 0.101]),
                        draft_seconds=0.01, probe=False)
    assert policy.counts(held(1), [3], 1, 1) == [3] and policy.counts(held(64), [3] * 64, 64, 64) == [3] * 64
    policy.draft_cost = StepCostTable([1, 64], [0.01, 10.0])
    assert policy.drafting_seconds(64) == pytest.approx(10.0)
    assert policy.counts(held(1), [3], 1, 1) == [3]
    assert policy.counts(held(64), [3] * 64, 64, 64) == [0] * 64
