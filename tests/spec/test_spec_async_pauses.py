"""An adaptive engine's drafting pauses through async scheduling (spec/async_pauses.py), on the CPU (forced on with
DEEPINFER_SPEC_ASYNC_PAUSES=1; async scheduling runs on the CPU too, the forward inside the host's call).

The engine is made to pause: a step-cost table where every verified token costs a second, so no draft ever pays
(the policy pauses 32, 64, ... steps, probing between), or a pause set directly. Checked: the output equals
speculation off (greedy, seeded T > 0, stops inside a pause); steps were delegated, and the speculation stats are
those of the same run with sync pauses; the MTP KV after an async pause equals a never-paused run's (and differs
without the hidden-state tap); preemption and abort during delegated steps leak no block and no kept row; a grammar,
a waiting request and a prompt part-way through its chunks keep the steps on the spec path.
"""

from __future__ import annotations

import pytest
import torch
from mtp_snapshots import MTPSnapshots, first_after_pause

from deepinfer import EngineConfig, SamplingParams, StructuredOutputsParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.errors import ConfigError
from deepinfer.spec.async_pauses import GRAMMAR, LAST, PROMPT, AsyncPauses
from deepinfer.spec.scheduler import StepCostTable

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef list_files(path):\n"]
NO_PAY = StepCostTable([1, 4096], [1.0, 4096.0])  # a second per token: a verified draft never pays
FLAT = StepCostTable([1, 4096], [10.0, 10.1])  # a verified draft always pays: no pause but the one a test sets


def make(parts, monkeypatch, async_pauses: bool | None = True, cost=NO_PAY, **kw) -> DeepInferenceEngine:
    path, backend, model, tok = parts
    if async_pauses is None:
        monkeypatch.delenv("DEEPINFER_SPEC_ASYNC_PAUSES", raising=False)
    else:
        monkeypatch.setenv("DEEPINFER_SPEC_ASYNC_PAUSES", "1" if async_pauses else "0")
    settings = dict(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=256, num_kv_blocks=64,
                    load_progress=False)
    settings.update(kw)
    engine = DeepInferenceEngine.from_components(EngineConfig(**settings), model, tok, backend)
    if engine._spec is not None and cost is not None:
        engine._spec.policy.cost = cost
        # plans by the table from the first plan (the measuring plans of a new load would draft full chains first),
        # pausing wherever drafting does not pay at all (no margin): NO_PAY pauses at once
        engine._spec.policy.measure_steps = 0
        engine._spec.policy.pause_margin = 0.0
    return engine


def adaptive(parts, monkeypatch, async_pauses: bool | None = True, **kw) -> DeepInferenceEngine:
    return make(parts, monkeypatch, async_pauses, speculative_method="mtp", num_speculative_tokens=3,
                speculative_adaptive=True, **kw)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def spec_counts(st) -> tuple:
    return (st.spec_steps, st.spec_request_steps, st.spec_drafted_tokens, st.spec_accepted_tokens,
            st.generation_tokens_total)


def test_pauses_run_async_with_the_output_and_stats_of_sync_pauses(parts, monkeypatch):
    off = make(parts, monkeypatch, cost=None)
    on, sync = adaptive(parts, monkeypatch), adaptive(parts, monkeypatch, async_pauses=False)
    assert on._spec.async_pauses is not None and sync._spec.async_pauses is None
    # pauses end only at their length here: a fall in load ends one a step later in async (its steps are scheduled
    # before the step in flight resolves), which would move every later count by a step; the seeded run below has it
    on._spec.policy.load_fall_steps = sync._spec.policy.load_fall_steps = 10**9
    # greedy with stops inside the pause (max_tokens 20 and 33: their sequences finish while steps are in flight)
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (48, 20, 33)]
    want = ids(off.generate(PROMPTS, greedy, use_tqdm=False))
    assert ids(on.generate(PROMPTS, greedy, use_tqdm=False)) == want
    assert ids(sync.generate(PROMPTS, greedy, use_tqdm=False)) == want
    pauses = on._spec.async_pauses
    # one pause of 32 steps (30 delegated, the last sync), then a probe and the next pause, to the end of the run
    assert pauses.num_steps >= 30 and pauses.sync_steps[LAST] >= 1 and pauses.num_drains >= 1
    assert on.stats().spec_async_steps == pauses.num_steps and sync.stats().spec_async_steps == 0
    # every delegated call is a step phase of its own kind (spec/step_phases.py); the sync engine has none
    ph = on._spec.phases.per_step_ms()
    assert on._spec.phases.steps["async_pause"] >= pauses.num_steps and ph["async_pause"]["launch"] > 0
    assert "async_pause" not in sync._spec.phases.steps and sync._spec.phases.steps["plain"] >= pauses.num_steps
    assert spec_counts(on.stats()) == spec_counts(sync.stats())  # every resolved step recorded as a sync one is
    assert not on.has_unfinished_requests() and on.stats().kv_blocks_used == 0
    assert len(on._spec.paused_rows) == 0 and not on._spec.paused_rows.kept  # finished sequences' rows dropped
    # the delegated steps were observed as plain steps (this run's sync steps all prefill, verify or draft)
    assert any(kind == "plain" for kind, *_ in on._spec.policy.step_times.rows())
    # seeded T > 0 (EOS on: sequences end wherever their draws end them)
    seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=11)
    n0 = pauses.num_steps
    assert ids(on.generate(PROMPTS, seeded, use_tqdm=False)) == ids(off.generate(PROMPTS, seeded, use_tqdm=False))
    assert pauses.num_steps > n0 and on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0
    # a pause ended by a fall in load (a delegated step ends it; the next step probes on the spec path)
    on._spec.policy.load_fall_steps = 4
    assert ids(on.generate(PROMPTS, greedy, use_tqdm=False)) == want
    assert on._spec.policy.num_load_ends >= 1 and on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0


PAUSE = 12


def snapshot_run(parts, monkeypatch, pauses: AsyncPauses | type | None, pause: int) -> tuple[dict, object]:
    """A two-prompt greedy run that starts with `pause` steps of pause (0: never pauses), recording the MTP KV each
    draft is made over; pauses: a subclass of AsyncPauses to install, or None for sync pauses. (Its caller skips the
    start-up profiles, `unprofiled`: both tables are set here.)"""
    engine = make(parts, monkeypatch, async_pauses=pauses is not None, cost=FLAT, speculative_method="mtp",
                  num_speculative_tokens=1, speculative_adaptive=True)
    spec = engine._spec
    spec.policy.draft_cost = None  # FLAT's 10 s steps make any measured drafting time negligible
    spec.book = MTPSnapshots(engine)
    if pauses is not None and pauses is not AsyncPauses:
        spec.async_pauses = pauses(spec)
    spec.policy.paused, spec.policy.probe = pause, False
    engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=28, ignore_eos=True), use_tqdm=False)
    return spec.book.seen, engine


class NoTap(AsyncPauses):
    """Delegated steps keep no rows: the async pause's positions stay holes in the MTP cache."""

    def _tap(self, sched, batch, hidden) -> None:
        return None


def test_the_mtp_kv_after_an_async_pause_is_a_never_paused_runs(parts, monkeypatch, unprofiled):
    ref, _ = snapshot_run(parts, monkeypatch, None, 0)
    got, engine = snapshot_run(parts, monkeypatch, AsyncPauses, PAUSE)
    # the prompt's step and the pause's last step run the spec path; the PAUSE - 2 decode steps between are async
    assert engine._spec.async_pauses.num_steps == PAUSE - 2
    assert engine._spec.paused_rows.num_caught_up >= 2 * (PAUSE - 2)  # their decode rows, both sequences
    for prompt in PROMPTS[:2]:
        n = first_after_pause(got, prompt)
        want_n = min(m for p, m in ref if p == prompt and m >= n)  # the reference's first put covering them
        entries, conf = got[(prompt, n)]
        assert n > PAUSE - 2  # the first draft came after the paused decode steps
        torch.testing.assert_close(entries, ref[(prompt, want_n)][0][:n], rtol=1e-5, atol=1e-5)
        if want_n == n:
            assert conf == pytest.approx(ref[(prompt, n)][1], abs=1e-4)
    # negative control: without the tap the async steps' positions are holes, which the comparison above catches
    holes, engine = snapshot_run(parts, monkeypatch, NoTap, PAUSE)
    assert engine._spec.async_pauses.num_steps == PAUSE - 2
    prompt = PROMPTS[0]
    n = first_after_pause(holes, prompt)
    want_n = min(m for p, m in ref if p == prompt and m >= n)
    diff = (holes[(prompt, n)][0] - ref[(prompt, want_n)][0][:n]).abs().amax(dim=-1)
    assert (diff > 1e-3).sum() >= PAUSE - 2  # the async decodes' positions differ; the prompt's do not
    assert (diff[: len(engine.tokenizer.encode(prompt)) - 1] < 1e-5).all()


def test_preemption_during_async_pauses(parts, monkeypatch):
    """An 8-block cache (128 tokens) cannot hold three sequences of ~52 tokens: preemption comes in the first pause,
    with a delegated step in flight, which the async pipeline resolves first (as async scheduling does); the
    preempted sequence's recompute runs the spec path; the output is off's and every block and kept row returns."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = make(parts, monkeypatch, cost=None, num_kv_blocks=8, max_model_len=128)
    on = adaptive(parts, monkeypatch, num_kv_blocks=8, max_model_len=128)
    assert ids(on.generate(PROMPTS, params, use_tqdm=False)) == ids(off.generate(PROMPTS, params, use_tqdm=False))
    pauses = on._spec.async_pauses
    st = on.stats()
    assert st.num_preemptions > 0 and pauses.num_steps > 0, (st, pauses.sync_steps)
    assert pauses.inner.num_sync_fallbacks > 0 and st.num_sync_fallbacks == pauses.inner.num_sync_fallbacks
    assert pauses.sync_steps[PROMPT] > 0  # the recompute's chunks ran the spec path
    assert st.kv_blocks_used == 0 and len(on._spec.paused_rows) == 0


def step_until(engine, done) -> list:
    outs = []
    for _ in range(400):
        if done():
            return outs
        outs += engine.step()
    raise AssertionError("the engine did not get there in 400 steps")


def test_abort_during_an_async_pause_and_a_new_request_keeps_its_prompt_steps_sync(parts, monkeypatch):
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    off = make(parts, monkeypatch, cost=None, max_num_batched_tokens=8)
    want = {p: o.outputs[0].token_ids for p, o in zip(PROMPTS, off.generate(PROMPTS, greedy, use_tqdm=False))}
    # a token budget of 8: the third prompt (12 tokens) is prefilled in two chunks
    on = adaptive(parts, monkeypatch, max_num_batched_tokens=8)
    pauses = on._spec.async_pauses
    on.add_request("a", PROMPTS[0], greedy)
    on.add_request("b", PROMPTS[1], greedy)
    step_until(on, lambda: pauses.num_steps >= 3)
    assert pauses.has_pending() and on.has_unfinished_requests()
    aborted = on.abort_request("b")
    assert aborted.outputs[0].finish_reason == "abort"
    step_until(on, lambda: pauses.num_steps >= 6)  # the aborted sequence's in-flight token was dropped
    assert all(k.seq.request.request_id == "a" for k in on._spec.paused_rows.kept.values())
    steps, prompt_syncs = pauses.num_steps, pauses.sync_steps[PROMPT]
    on.add_request("c", PROMPTS[2], greedy)  # waits: the next step drains and runs the spec path (its prefill)
    on.step()
    assert not pauses.has_pending() and pauses.num_steps == steps and pauses.sync_steps[PROMPT] == prompt_syncs + 1
    on.step()  # its second chunk: part-way through its prompt, still the spec path
    assert not pauses.has_pending() and pauses.num_steps == steps and pauses.sync_steps[PROMPT] == prompt_syncs + 2
    outs = step_until(on, lambda: not on.has_unfinished_requests())
    assert pauses.num_steps > steps  # the pause went on async once "c" decoded
    final = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert final["a"] == want[PROMPTS[0]] and final["c"] == want[PROMPTS[2]]
    assert aborted.outputs[0].token_ids == want[PROMPTS[1]][: len(aborted.outputs[0].token_ids)]
    assert on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0


def test_a_full_batch_with_a_queue_pauses_async_until_a_slot_frees(parts, monkeypatch):
    """max_num_seqs 2, three requests: the third waits while the batch is full, and the pause goes on async (no
    step can admit it); once the first finishes, the step that admits it runs the spec path."""
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (24, 40, 40)]
    off = make(parts, monkeypatch, cost=None, max_num_seqs=2)
    want = ids(off.generate(PROMPTS, params, use_tqdm=False))
    on = adaptive(parts, monkeypatch, max_num_seqs=2)
    pauses = on._spec.async_pauses
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        on.add_request(str(i), prompt, p)
    queued_async = 0  # calls after which a delegated step was in flight while the third request waited
    outs = []
    while on.has_unfinished_requests():
        outs += on.step()
        queued_async += bool(on.scheduler.waiting and pauses.has_pending())
    assert queued_async >= 10 and pauses.sync_steps[PROMPT] >= 1, (queued_async, pauses.sync_steps)
    final = {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}
    assert [final[str(i)] for i in range(3)] == want
    assert on.stats().kv_blocks_used == 0 and len(on._spec.paused_rows) == 0


def test_structured_requests_keep_pause_steps_sync(parts, monkeypatch):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}}, "required": ["name"]}
    params = SamplingParams(temperature=0.0, max_tokens=40,
                            structured_outputs=StructuredOutputsParams(json=schema, whitespace="compact"))
    off = make(parts, monkeypatch, cost=None)
    on = adaptive(parts, monkeypatch)
    assert ids(on.generate(PROMPTS[:2], params, use_tqdm=False)) == ids(off.generate(PROMPTS[:2], params,
                                                                                     use_tqdm=False))
    pauses = on._spec.async_pauses
    assert pauses.num_steps == 0 and pauses.sync_steps[GRAMMAR] > 0, pauses.sync_steps


def test_where_async_pauses_run_and_what_is_refused(parts, monkeypatch):
    assert adaptive(parts, monkeypatch, async_pauses=None)._spec.async_pauses is None  # the CPU: off by default
    static = make(parts, monkeypatch, speculative_method="mtp", num_speculative_tokens=3)
    assert static._spec.async_pauses is None  # no pauses: the variable does not apply
    with pytest.raises(ConfigError, match="DEEPINFER_SPEC_ASYNC_PAUSES=1.*ngram"):
        make(parts, monkeypatch, speculative_method="ngram", num_speculative_tokens=3, speculative_adaptive=True)
    with pytest.raises(ConfigError, match="DEEPINFER_SPEC_ASYNC_PAUSES=1.*async_scheduling=False"):
        adaptive(parts, monkeypatch, async_scheduling=False)
    with pytest.raises(ConfigError, match="async_scheduling=True"):  # speculative steps async: still refused
        adaptive(parts, monkeypatch, async_scheduling=True)
