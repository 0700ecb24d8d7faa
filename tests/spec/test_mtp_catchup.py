"""MTP-KV catch-up after an adaptive pause (spec/mtp_catchup.py): the positions decoded while drafting was paused
get the MTP KV the per-step passes would have written, so drafts after a pause are the drafts of a run that
never paused. Without the catch-up (negative control) those positions are holes and the drafts' confidences move.
"""

from __future__ import annotations

import pytest
import torch
from mtp_snapshots import MTPSnapshots, first_after_pause

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.spec.mtp_catchup import PausedRows
from deepinfer.spec.scheduler import StepCostTable

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n"]
FLAT = StepCostTable([1, 4096], [10.0, 10.1])  # drafting always pays: no pause but the one the test makes
PAUSE = 12


def make(parts, **kw) -> DeepInferenceEngine:
    path, backend, model, tok = parts
    cfg = EngineConfig(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
                       load_progress=False, speculative_method="mtp", num_speculative_tokens=1,
                       speculative_adaptive=True, **kw)
    engine = DeepInferenceEngine.from_components(cfg, model, tok, backend)  # (the tests skip the profiles: `unprofiled`)
    engine._spec.policy.cost = FLAT
    engine._spec.policy.draft_cost = None  # FLAT's 10 s steps make any measured drafting time negligible
    engine._spec.book = MTPSnapshots(engine)
    return engine


def run(engine, pause: int) -> dict:
    policy = engine._spec.policy
    policy.paused, policy.probe = pause, False
    params = SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True)
    engine.generate(PROMPTS, params, use_tqdm=False)
    return engine._spec.book.seen


def test_drafts_after_a_pause_see_the_mtp_kv_of_the_paused_positions(parts, unprofiled):
    ref_engine = make(parts)
    ref = run(ref_engine, 0)
    paused_engine = make(parts)
    got = run(paused_engine, PAUSE)
    assert paused_engine._spec.paused_rows.num_caught_up >= 2 * (PAUSE - 2)  # the decodes of the pause, both seqs
    # the step whose pass caught up is a step phase of its own kind, its pass and chain timed (spec/step_phases.py)
    phases = paused_engine._spec.phases.per_step_ms()
    assert phases["catch_up"]["steps"] >= 1 and phases["catch_up"]["draft"] > 0
    assert "catch_up" not in ref_engine._spec.phases.per_step_ms()  # never paused: nothing to catch up
    for prompt in PROMPTS:
        n = first_after_pause(got, prompt)
        want_n = min(m for p, m in ref if p == prompt and m >= n)  # the reference's first put covering them
        entries, conf = got[(prompt, n)]
        want = ref[(prompt, want_n)][0][:n]
        assert n > PAUSE - 2  # the first draft came after the paused decode steps
        torch.testing.assert_close(entries, want, rtol=1e-5, atol=1e-5)
        if want_n == n:
            assert conf == pytest.approx(ref[(prompt, n)][1], abs=1e-4)


class NoCatchUp(PausedRows):
    """Keeps nothing: the paused positions stay holes (the behaviour before the catch-up)."""

    def keep(self, rows, hidden) -> bool:
        return True


def test_without_the_catch_up_the_paused_positions_are_holes(parts, unprofiled):
    """Negative control: the same pause with nothing kept leaves the MTP KV of the paused decodes unwritten, which
    the comparison above would catch."""
    ref = run(make(parts), 0)
    engine = make(parts)
    engine._spec.paused_rows = NoCatchUp()
    got = run(engine, PAUSE)
    prompt = PROMPTS[0]
    n = first_after_pause(got, prompt)
    want_n = min(m for p, m in ref if p == prompt and m >= n)
    diff = (got[(prompt, n)][0] - ref[(prompt, want_n)][0][:n]).abs().amax(dim=-1)
    assert (diff > 1e-3).sum() >= PAUSE - 2  # the paused decodes' positions differ; the prompt's do not
    assert (diff[: len(engine.tokenizer.encode(prompt)) - 1] < 1e-5).all()


class FakeSeq:
    def __init__(self, sid: str, tokens: list[int]):
        self.seq_id, self.tokens = sid, tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return self.tokens[start:end]


def test_kept_rows_merge_in_front_of_their_sequences_rows_and_reset_when_not_contiguous():
    from deepinfer.spec.mtp_drafter import MTPRows

    a, b = FakeSeq("a", list(range(100, 120))), FakeSeq("b", list(range(200, 220)))
    kept = PausedRows(max_rows=6)
    h1 = torch.arange(6, dtype=torch.float32).view(3, 2)  # a step: a decodes at 10 (row 0), b at 4 (row 2)
    kept.keep([(a, 0, 10), (b, 2, 4)], h1)
    h2 = torch.arange(6, 12, dtype=torch.float32).view(3, 2)  # a at 11 (row 1); b at 7: not contiguous, restarts
    kept.keep([(a, 1, 11), (b, 0, 7)], h2)
    assert len(kept) == 4 and kept.kept["b"].first_position == 7 and len(kept.kept["b"].refs) == 1
    step = torch.arange(100, 108, dtype=torch.float32).view(4, 2)  # a pass: a at 12 (rows 0-1), b at 8 (rows 2-3)
    rows = [MTPRows(0, 2, [113, 114], 12, True, 0), MTPRows(2, 2, [209, 210], 8, True, 1)]
    merged, out = kept.plan(rows, [a, b], step)
    # a: kept positions 10, 11 (h1 row 0, h2 row 1), then its own 2 rows; b: kept position 7 (h2 row 0), then its own
    assert out[0] == MTPRows(0, 4, [111, 112, 113, 114], 10, True, 0)
    assert out[1] == MTPRows(4, 3, [208, 209, 210], 7, True, 1)
    assert merged.tolist() == [[0, 1], [8, 9], [100, 101], [102, 103], [6, 7], [104, 105], [106, 107]]
    assert len(kept) == 0 and not kept.kept and not kept.blocks and kept.num_caught_up == 3


def test_a_sequence_not_in_the_pass_keeps_its_rows_and_the_cap_drops_the_oldest_step():
    from deepinfer.spec.mtp_drafter import MTPRows

    a, b = FakeSeq("a", list(range(100, 120))), FakeSeq("b", list(range(200, 220)))
    kept = PausedRows(max_rows=4)
    h = torch.arange(4, dtype=torch.float32).view(2, 2)
    kept.keep([(a, 0, 5), (b, 1, 9)], h)
    kept.keep([(a, 1, 6), (b, 0, 10)], h.flip(0))
    step = torch.full((1, 2), 50.0)
    merged, out = kept.plan([MTPRows(0, 1, [108], 7, True, 0)], [a], step)  # a's pass only: b keeps its rows
    assert out == [MTPRows(0, 3, [106, 107, 108], 5, True, 0)] and merged.tolist() == [[0, 1], [0, 1], [50, 50]]
    assert list(kept.kept) == ["b"] and len(kept) == 4  # both step copies still hold b's rows
    kept.keep([(b, 0, 11)], h)  # 6 rows allocated > 4: the oldest step goes, b's position 9 with it
    assert kept.num_dropped == 1 and kept.kept["b"].first_position == 10 and len(kept) == 3
    merged, out = kept.plan([MTPRows(0, 1, [212], 12, True, 1)], [b], step)
    assert out == [MTPRows(0, 3, [211, 212, 212], 10, True, 1)] and merged.tolist() == [[2, 3], [0, 1], [50, 50]]
    kept.keep([(a, 0, 12)], h)
    kept.drop(a)
    merged, out = kept.plan([MTPRows(0, 1, [113], 13, True, 0)], [a], step)
    assert merged is step and not kept.blocks  # dropped: its own rows only, the copies freed
    with pytest.raises(ValueError, match="max_rows"):
        PausedRows(max_rows=0)


def test_rows_of_sequences_that_finish_within_the_pause_are_not_worth_keeping():
    """PausedRows.all_finish_within: every sequence ends (max_tokens, else max_model_len) within the steps left."""
    from types import SimpleNamespace

    def seq(max_tokens, out, prompt=10):
        params = SimpleNamespace(max_tokens=max_tokens)
        return SimpleNamespace(request=SimpleNamespace(params=params), params=params, output_token_ids=[0] * out,
                               num_pending=0, num_tokens=prompt + out)

    finishing = [seq(128, 100), seq(128, 120)]  # 28 and 8 tokens left
    assert PausedRows.all_finish_within(finishing, 32, 4096)
    assert not PausedRows.all_finish_within(finishing, 16, 4096)
    assert not PausedRows.all_finish_within([*finishing, seq(None, 5)], 32, 4096)  # no max_tokens
    assert PausedRows.all_finish_within([seq(None, 5)], 32, 40)  # max_model_len: 25 tokens left
