"""The one-sync speculative step (spec/one_sync.py): verification, the MTP pass and the chain on the device, one
read-back per step. On the nvidia backend under the Triton interpreter with the stand-in graph API (the tiny drafting
checkpoint of test_spec_nvidia_interpreter.py, fp32), and on a GPU with real CUDA graphs (gpu marker).

- `finish` against the host path's drafter over the host path's rows (partial, full and no acceptance; a sequence
  whose room cuts its chain): the same accepted counts and emitted tokens, the same drafts, confidences and MTP KV;
- an engine: output == speculation off (greedy and seeded, partial acceptance, rollback), the same drafts as the
  host path (same acceptance counts), every decode step one-sync with one read-back, the host path two or more;
- on a GPU: no synchronizing call inside a one-sync step but its one read-back (torch.cuda sync debug mode).
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from test_spec_mtp_graphs import parts, prefill, setup_drafters  # noqa: F401 (parts: the module's fixture)
from test_spec_nvidia_interpreter import DEVICE, GREEDY, SEEDED, make, run

from deepinfer.sample.sampler import DeviceSample
from deepinfer.spec.mtp_drafter import MTPRows
from deepinfer.spec.one_sync import OneSyncStep


class RoomKV:
    """What prepare asks of the KV manager: a sequence's row, and whether its next n tokens fit its room."""

    def __init__(self, rows: dict[str, int], room: dict[str, int]):
        self.rows, self.room = rows, room

    def state_slot(self, seq_id: str) -> int:
        return self.rows[seq_id]

    def try_extend(self, seq, n: int) -> bool:
        return seq.num_computed_tokens + n <= self.room[seq.seq_id]

    def can_allocate(self, seq, n: int) -> bool:
        return False


def scheduled(seq_id: str, ctx: int, draft: list[int]):
    seq = SimpleNamespace(seq_id=seq_id, grammar=None, num_computed_tokens=ctx)
    return SimpleNamespace(seq=seq, samples=True, num_tokens=1 + len(draft), draft=draft, context_len=ctx)


def test_finish_equals_the_host_paths_verification_and_drafter(parts):  # noqa: F811
    """Three sequences (KV rows 1, 3, 0) after 5 cached positions verify 3, 2 and 2 drafts; the draw accepts none,
    all 2 (the bonus token) and 1; sequence 3's room cuts its chain to 1. (Sequence 1's rejected rows reach past
    its chain's lookahead, so a rejected row writing its MTP KV would show.) The one-sync step's accepted counts, emitted
    tokens, drafts, confidences and MTP KV == the host path's (greedy_verify on the host, then the drafter over
    the accepted rows, eagerly)."""
    _, backend, model, _, _ = parts
    k, ctx = 3, 5
    ((eager, eager_caches), (graph, graph_caches)), mirror = setup_drafters(backend, model, [1, 2, 4, 8, 16], 4, k)
    rows, drafts = [1, 3, 0], [[7, 8, 9], [20, 21], [50, 51]]
    for d in (eager, graph):
        prefill(d, rows, ctx, 1, mirror)
    items = [scheduled(f"s{r}", ctx, d) for r, d in zip(rows, drafts)]
    # room: s3 covers its verify rows only (ctx + 3): all 2 accepted -> chain min(3, 3 - 2) = 1
    kv = RoomKV({f"s{r}": r for r in rows}, {"s1": 64, "s3": ctx + 3, "s0": 64})
    step = OneSyncStep(graph.graphs, torch.device(DEVICE))
    plan = step.prepare(items, kv, k, max_model_len=64)
    assert (plan.t, plan.b, plan.k, plan.links) == (10, 3, 3, 3)
    # the draw at each verify row: s1 draws 30 for 7; s3 accepts 20, 21, then the bonus 31; s0 accepts 50, draws 60
    chosen = torch.tensor([30, 40, 41, 42, 20, 21, 31, 50, 60, 43], device=DEVICE)
    hidden = torch.randn(10, model.config.hidden_size, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    res = step.finish(plan, DeviceSample(chosen, [], [], []), hidden)
    assert res.num_accepted == [0, 2, 1]
    assert res.emitted == [[30], [20, 21, 31], [50, 60]]
    assert step.num_host_reads == step.num_steps == 1
    # the host path: the pass over each sequence's accepted rows + 1, next token = the emitted one; its chain rule
    host_rows = [MTPRows(0, 1, [30], ctx, True, 1), MTPRows(4, 3, [20, 21, 31], ctx, True, 3),
                 MTPRows(7, 2, [50, 60], ctx, True, 0)]
    want = eager.run(hidden, host_rows, [3, 1, 3], mirror)
    assert res.drafts == want.tokens and [len(d) for d in res.drafts] == [3, 1, 3]
    for a, b in zip(res.confidence, want.confidence):
        assert a == pytest.approx(b, abs=1e-5)
    for key, t in eager_caches.kv.items():  # the accepted rows' MTP KV and each live link's, nothing else
        torch.testing.assert_close(graph_caches.kv[key], t, atol=1e-5, rtol=1e-5)
    assert graph.graphs.num_chain_replays == 1 and graph.graphs.num_pass_replays >= 1


def test_engine_one_sync_equals_off_and_the_host_path(parts):  # noqa: F811
    """mtp k = 3, greedy and seeded requests in one batch, decode and MTP graphs (stand-in): the tokens of speculation
    off (eager) and of the host path (one_sync None), with the host path's drafts (the same drafted and accepted
    counts per slot); every decode step ran one-sync with one read-back (the prompts' step took the host path: its
    draw and its drafts), where the host path waited twice or more per step; every block came back."""
    ps = parts[4]
    mixed, params = ps + ps[-1:], [GREEDY] * len(ps) + [SEEDED]
    want, _ = run(make(parts, enforce_eager=True), mixed, params)
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    host = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    assert on._spec.one_sync is not None
    host._spec.one_sync = None
    got, _ = run(on, mixed, params)
    assert got == want
    assert run(host, mixed, params)[0] == want
    a, b = on.stats(), host.stats()
    assert (a.spec_drafted_tokens, a.spec_accepted_tokens, a.spec_conditional_acceptance) == \
        (b.spec_drafted_tokens, b.spec_accepted_tokens, b.spec_conditional_acceptance)
    assert 0 < a.spec_accepted_tokens < a.spec_drafted_tokens, a  # partial acceptance: rolled back
    spec, hs = on._spec, host._spec
    assert spec.one_sync.num_steps == spec.metrics.steps >= 3
    assert spec.one_sync.num_host_reads == spec.one_sync.num_steps
    assert spec.host_reads() == spec.one_sync.num_steps + 2
    assert hs.host_reads() >= 2 * hs.metrics.steps + 2
    assert a.kv_blocks_used == 0
    # the step phases (spec/step_phases.py) count each path's steps and forward tokens: the one-sync steps' tokens
    # are their sequences' decode tokens plus every verified draft; only one-sync steps have a read-back wait (each
    # resolved by the next engine call: "overlapped", spec/overlap.py)
    ph, hph = spec.phases, hs.phases
    assert spec.num_overlapped_steps == spec.one_sync.num_steps
    assert ph.steps["overlapped"] == spec.one_sync.num_steps and ph.steps["host"] == 1
    assert "overlapped" not in hph.steps and "one_sync" not in hph.steps and "one_sync" not in ph.steps
    assert ph.tokens["overlapped"] == a.spec_request_steps + a.spec_drafted_tokens
    assert hph.steps["host"] == hs.metrics.steps + 1 and hph.seconds.get(("host", "wait"), 0.0) == 0.0
    assert ph.seconds[("overlapped", "wait")] >= 0.0 and all(v >= 0.0 for v in ph.seconds.values())


def test_one_sync_rooms_staged_after_the_forward_reach_a_separate_device_mirror(parts, monkeypatch):  # noqa: F811
    """The rooms of a one-sync step are covered once its forward is launched (`OneSyncStep.stage`), after the batch
    builder synced the device's block tables, so the pipeline syncs them again before the chain reads them. On a
    GPU the tables live apart from the host's (BatchBuilder's separate mirror); here the builder is made to keep one
    on the CPU too. 12 new tokens from prompts of 5-10 tokens: lookaheads cross into blocks only a room allocated.
    Every chain's drafts and confidences equal the shared tables' engine's (without that second sync a confidence
    differed: checked), and both engines' tokens equal speculation off's."""
    from deepinfer.worker import model_runner
    from deepinfer.worker.batch_builder import BatchBuilder

    class SeparateMirror(BatchBuilder):
        def __init__(self, kv, device):
            super().__init__(kv, device, separate_mirror=True)

    ps = parts[4]
    params = [replace(GREEDY, max_tokens=12)] * len(ps)
    want, _ = run(make(parts, enforce_eager=True), ps, params)
    shared = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    monkeypatch.setattr(model_runner, "BatchBuilder", SeparateMirror)
    sep = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    assert sep.runner.builder.separate and not shared.runner.builder.separate
    chains: dict[str, list] = {"shared": [], "sep": []}
    for name, engine in (("shared", shared), ("sep", sep)):
        collect = engine._spec.one_sync.collect  # (each one-sync step's read-back: spec/overlap.py)

        def recording_collect(*args, collect=collect, into=chains[name], **kw):
            res = collect(*args, **kw)
            into.append((res.drafts, res.confidence))
            return res

        engine._spec.one_sync.collect = recording_collect
    assert run(shared, ps, params)[0] == want
    assert run(sep, ps, params)[0] == want
    assert len(chains["sep"]) == len(chains["shared"]) >= 3
    for (da, ca), (db, cb) in zip(chains["shared"], chains["sep"]):  # every chain's drafts and confidences
        assert da == db
        flat_a, flat_b = [c for row in ca for c in row], [c for row in cb for c in row]
        assert torch.allclose(torch.tensor(flat_a), torch.tensor(flat_b), atol=1e-6)
    a, b = shared.stats(), sep.stats()
    assert sep._spec.one_sync.num_steps == shared._spec.one_sync.num_steps >= 3
    assert (b.spec_drafted_tokens, b.spec_accepted_tokens, b.spec_conditional_acceptance) == \
        (a.spec_drafted_tokens, a.spec_accepted_tokens, a.spec_conditional_acceptance)
    assert a.spec_accepted_tokens > 0 and b.kv_blocks_used == 0


def test_adaptive_steps_run_one_sync_with_the_chain_planned_before_them(parts, unprofiled):  # noqa: F811
    """The confidence scheduler plans each step's chain before its forward (spec/pipeline.py `_step`), so its
    steps qualify for the one-sync step as static k's do. mtp k = 2 adaptive, tables where a chain of 1 pays and a
    chain of 2 never does: the first drafting is the probe (full chains, drafted by the prompts' step on the host
    path), its verification plans after the draw (host path: the plan must see the probe's outcome), and every later
    step plans chains of 1 before its forward (one-sync with 1 link: the chain graph's head alone, fewer links than
    the graphs were captured for). Greedy and seeded output equals speculation off."""
    from dataclasses import replace

    from deepinfer.spec.draft_cost import DraftCostTable
    from deepinfer.spec.scheduler import StepCostTable

    ps = parts[4][:2]
    params = [replace(GREEDY, max_tokens=10), replace(SEEDED, max_tokens=10)]
    want, _ = run(make(parts, enforce_eager=True), ps, params)
    # token budget 16: both prompts in one step (a step with a prompt chunk takes the host path); the start-up
    # profiles are skipped (`unprofiled`): the tables are set below
    on = make(parts, speculative_method="mtp", num_speculative_tokens=2, speculative_adaptive=True,
              max_num_batched_tokens=16, max_num_seqs=2)
    spec = on._spec
    assert spec.one_sync is not None and spec.policy.adaptive
    spec.policy.cost = StepCostTable([1, 4096], [0.01, 0.0101])  # verified tokens almost free
    spec.policy.draft_cost = DraftCostTable(2, StepCostTable([1, 64], [1e-4, 1e-4]), StepCostTable([1, 64], [1.0, 1.0]))
    spec.policy.measure_steps = 0  # plans by these tables from the first (a measuring plan would draft full chains)
    spec.policy.realized.decides = False  # and by them only (the interpreter's measured rates would overrule them)
    links: list[int] = []
    qualify = spec.one_sync.qualify

    def recording_qualify(items, want_links):
        plan = qualify(items, want_links)
        if plan is not None:
            links.append(plan.links)
        return plan

    spec.one_sync.qualify = recording_qualify
    got, _ = run(on, ps, params)
    assert got == want
    assert len(links) >= 3 and set(links) == {1}, links  # (the probe's full chains: drafted by the prompts' step)
    # every verify step one-sync but the probe's verification (planned after its draw: spec/slot_policy.py
    # plans_before_the_draw)
    assert spec.one_sync.num_steps == len(links) == spec.metrics.steps - 1
    assert spec.policy_steps > spec.metrics.steps and spec.policy_seconds > 0  # (and the prompts' step)
    assert on.stats().spec_accepted_tokens > 0 and on.stats().kv_blocks_used == 0


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")
@pytest.mark.parametrize("async_scheduling", [None, True], ids=["overlapped", "chained"])
def test_gpu_one_sync_steps_make_no_other_synchronizing_call(parts, async_scheduling):  # noqa: F811
    """Real CUDA graphs: after the prompts' step, every step runs one-sync under torch.cuda's sync debug mode
    "error" (a .tolist() / .item() / pageable copy of a device tensor raises): its one read-back waits on an event,
    nothing else waits for the device. Each step's read-back is the next call's (spec/overlap.py): the first call
    only launches; with async scheduling the steps after it are launched on the device results of the one in
    flight (spec/chained_steps.py), which must not wait for the device either."""
    ps = parts[4]
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3, async_scheduling=async_scheduling)
    for i, p in enumerate(ps):
        on.add_request(f"r{i}", p, GREEDY)
    on.step()  # the prompts: the host path
    before = on._spec.one_sync.num_steps
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        while on.has_unfinished_requests():
            on.step()
            steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert steps > 1 and on._spec.one_sync.num_steps - before == steps - 1  # (the last call launches none)
    assert (on._spec.num_chained_steps > 0) == bool(async_scheduling)
