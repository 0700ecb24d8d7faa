"""Async scheduling of speculative steps (spec/chained_steps.py): the next one-sync step launched on the device results
of the one in flight. On the nvidia backend under the Triton interpreter with the stand-in graph API (the tiny
drafting checkpoint of test_spec_nvidia_interpreter.py, fp32), mtp static k.

- call by call, overlapped output (spec/overlap.py) == each step's read-back in its own call, and chained steps ==
  it, greedy, seeded and random (engine seed) requests (their draws keyed by the device's corrected positions),
  partial acceptance rolled back, a stop string and a stop token landing mid-stream, max_tokens mid-draft,
  logprobs, a penalized request (its steps wait for the read-back: counted), the first request finishing first (the
  next step chains on the rows of the others: its rows of N left out); every block back;
- a tight KV cache: the next step waits (counted), the scheduler preempts as sync's does, output unchanged;
- (an abort and a detokenizer failure with a chained step in flight: test_spec_overlap.py)
- the confidence scheduler's steps chain with its plan as their budget, tokens == its sync engine's;
- the refusals at start-up (n-gram, enforce_eager, overlap off) name the flag and the reason.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_spec_mtp_graphs import parts  # noqa: F401 (the module's fixture)
from test_spec_nvidia_interpreter import GREEDY, SEEDED, make
from test_spec_overlap import drive

from deepinfer.errors import ConfigError

K = 3


def engine(parts, async_scheduling: bool | None, **kw):  # noqa: F811
    e = make(parts, speculative_method="mtp", num_speculative_tokens=kw.pop("k", K), async_scheduling=async_scheduling,
             **kw)
    assert e._spec.one_sync is not None and e._spec.chaining == bool(async_scheduling)
    return e


def record_verifications(e) -> dict[str, list]:
    """request id -> [(accepted drafts, the drafts drafted after), ...] of every one-sync step, as they resolve."""
    seen: dict[str, list] = {}
    done = e._spec._one_sync_done

    def recording(rec, plan, sampling, res):
        for it, a, d in zip(rec.sched.scheduled, res.num_accepted, res.drafts):
            seen.setdefault(it.seq.request.request_id, []).append((a, tuple(d)))
        return done(rec, plan, sampling, res)

    e._spec._one_sync_done = recording
    return seen


def assert_same_outputs(got: dict, want: dict) -> None:
    """Every request's final output equal (text, token ids, finish and stop reasons, error; logprobs up to fp32
    rounding: a sync step near max_tokens verifies fewer drafts, so its rows replay another graph bucket), and its
    snapshots call by call equal but near the end: there a sync step verifies fewer drafts (max_tokens caps them),
    a chained step all of them, so the last tokens may come in fewer, larger pieces; every snapshot is a prefix of
    the final output."""
    assert got.keys() == want.keys()

    def same(g, w, rid):
        assert g[:4] == w[:4] and g[5:] == w[5:], rid
        assert (g[4] is None) == (w[4] is None), rid
        for dg, dw in zip(g[4] or [], w[4] or []):
            assert dg.keys() == dw.keys() and all(dg[t][1] == dw[t][1] for t in dw), rid
            assert all(dg[t][0] == pytest.approx(dw[t][0], abs=1e-5) for t in dw), rid

    for rid, w in want.items():
        g = got[rid]
        same(g[-1], w[-1], rid)
        n = min(len(g), len(w)) - 2
        for a, b in zip(g[:n], w[:n]):
            same(a, b, rid)
        final_ids, final_text = g[-1][1], g[-1][0]
        assert all(x[1] == final_ids[: len(x[1])] and final_text.startswith(x[0]) for x in g), rid


def test_overlapped_and_chained_steps_equal_the_sync_engine_call_by_call(parts, monkeypatch):  # noqa: F811
    """Six requests, greedy (logprobs), seeded, random (the engine's seed; max_tokens mid-draft), a stop string and a
    stop token landing mid-stream (its text included), min_tokens, a repetition penalty (its steps cannot chain:
    it finishes early, then the others chain): overlapped output == each step's read-back in its own call
    (DEEPINFER_SPEC_OVERLAP_OUTPUT=0), every snapshot exactly; chained steps == it as `assert_same_outputs` says, and
    every verification's accepted count and next drafts per request == sync's but the tail."""
    ps = parts[4]
    monkeypatch.setenv("DEEPINFER_SPEC_OVERLAP_OUTPUT", "0")
    # (g0's greedy text, for a stop string and a stop token inside it: speculation off, eager, one sequence, which
    # captures no graph; greedy speculation's tokens equal it, test_spec_nvidia_interpreter.py; and the asserts on
    # the "stop" and "tok" requests below fail if they did not)
    ref, _ = drive(make(parts, enforce_eager=True, max_num_seqs=1), [("g0", ps[0], replace(GREEDY, max_tokens=12,
                                                                                                logprobs=None))])
    text0, ids0 = ref["g0"][-1][0], ref["g0"][-1][1]
    stop = text0[len(text0) // 2: len(text0) // 2 + 2]
    assert stop.strip(), text0
    g = replace(GREEDY, max_tokens=15)
    # (seeded at a high temperature: most draws depend on their (seed, position) key, not on the logits alone)
    # (the request that finishes first leads the batch: the next step chains on the rows of N behind it)
    reqs = [("random", ps[1], replace(SEEDED, max_tokens=7, seed=None, temperature=0.7, top_k=20)),
            ("g0", ps[0], g), ("seeded", ps[2], replace(SEEDED, max_tokens=15, temperature=1.5, top_p=1.0)),
            ("stop", ps[0], replace(g, stop=[stop])),
            ("tok", ps[0], replace(g, stop_token_ids=[ids0[6]], include_stop_str_in_output=True, min_tokens=3)),
            ("penalty", ps[1], replace(g, max_tokens=5, repetition_penalty=1.3, logprobs=None))]
    settings = {"max_num_seqs": 6, "num_kv_blocks": 48, "seed": 11}  # (the unseeded request's seed: the engine's)
    sync = engine(parts, None, **settings)
    monkeypatch.setenv("DEEPINFER_SPEC_OVERLAP_OUTPUT", "1")
    overlapped = engine(parts, None, **settings)
    on = engine(parts, True, **settings)
    assert not sync._spec.overlap and overlapped._spec.overlap and on._spec.overlap
    history = {"sync": record_verifications(sync), "on": record_verifications(on)}
    want, empty_sync = drive(sync, reqs)
    got_overlapped, empty_overlapped = drive(overlapped, reqs)
    got, _ = drive(on, reqs)
    # overlapped output: the same steps, their outputs one call later (a launch-only call before them)
    assert got_overlapped == want
    assert empty_sync == 0 and empty_overlapped >= 1
    assert want["stop"][-1][2:4] == ("stop", stop) and want["tok"][-1][3] == ids0[6]
    assert len(want["random"][-1][1]) == 7 and want["random"][-1][2] == "length"
    spec_o = overlapped._spec
    assert spec_o.num_overlapped_steps == spec_o.one_sync.num_steps >= 3 and sync._spec.num_overlapped_steps == 0
    assert spec_o.phases.steps["overlapped"] == spec_o.num_overlapped_steps
    # chained steps
    assert_same_outputs(got, want)
    for rid in want:
        a, b = history["on"][rid], history["sync"][rid]
        n = min(len(a), len(b)) - 1
        assert n >= (3 if rid in ("g0", "seeded") else 0) and a[:n] == b[:n], rid
    spec = on._spec
    # (a step waits while the penalized request or the one below min_tokens runs: the first reason is counted)
    assert spec.num_chained_steps >= 3 and {"sampling", "min_tokens"} & set(spec.chain_fallbacks), spec.chain_fallbacks
    # (requests finishing at different steps: the next step chains without them, it does not wait)
    assert spec.num_chained_without_finished >= 1 and "batch_changed" not in spec.chain_fallbacks, spec.chain_fallbacks
    assert spec.phases.steps["chained"] == spec.num_chained_steps
    st = on.stats()  # (EngineStats: what a server's /stats reads)
    assert st.spec_chained_steps == spec.num_chained_steps and st.spec_overlapped_steps == spec.num_overlapped_steps
    assert overlapped.stats().spec_chained_steps == 0 and sync.stats().spec_overlapped_steps == 0
    b = sync.stats()
    assert 0 < b.spec_accepted_tokens < b.spec_drafted_tokens  # partial acceptance: rolled back
    assert on.stats().kv_blocks_used == 0 and spec._in_flight is None


def test_a_tight_kv_cache_falls_back_and_equals_sync(parts):  # noqa: F811
    """6 blocks of 16 for three sequences of up to ~28 tokens: the worst-case covers run out, the next step waits
    for the read-back (counted "kv") and the scheduler preempts as the sync engine's does: output == sync."""
    ps = parts[4]
    params = replace(GREEDY, max_tokens=18, logprobs=None)
    reqs = [(f"r{i}", p, params) for i, p in enumerate(ps)]
    want, _ = drive(engine(parts, None, num_kv_blocks=6), reqs)
    small = engine(parts, True, num_kv_blocks=6)
    got, _ = drive(small, reqs)
    assert_same_outputs(got, want)
    assert small._spec.chain_fallbacks.get("kv", 0) >= 1, small._spec.chain_fallbacks
    assert small.stats().kv_blocks_used == 0


def test_max_model_len_ends_chaining_and_the_sync_steps_finish(parts):  # noqa: F811
    """Two requests running into max_model_len (32): once N + 1's rows and its chain's lookahead would pass it, the
    next step waits ("length") and the sync steps shorten the chain and end the requests by length: output ==
    sync, no block left. (max_num_seqs 2: both run at once, and the graphs are captured for the 8 rows they verify.)"""
    ps = parts[4][:2]
    reqs = [(f"r{i}", p, replace(GREEDY, max_tokens=100, logprobs=None)) for i, p in enumerate(ps)]
    want, _ = drive(engine(parts, None, max_model_len=32, max_num_seqs=2), reqs)
    on = engine(parts, True, max_model_len=32, max_num_seqs=2)
    got, _ = drive(on, reqs)
    assert_same_outputs(got, want)
    assert all(w[-1][2] == "length" and len(ps[i]) + len(w[-1][1]) == 32 for i, w in enumerate(want.values()))
    assert on._spec.chain_fallbacks.get("length", 0) >= 1 and on._spec.num_chained_steps >= 3, on._spec.chain_fallbacks
    assert on.stats().kv_blocks_used == 0


def test_adaptive_steps_chain_with_their_plan_as_the_budget(parts, unprofiled):  # noqa: F811
    """The confidence scheduler with async scheduling: a step chains where the policy plans before the draw (its plan,
    made from past steps only, is the chained step's budget: every sequence verifies the planned chain, whose
    confidences are still on the device); a probe's verification or a pause runs sync with the plan already made.
    mtp k = 2, tables where a chain of 1 pays (as test_spec_one_sync.py's adaptive test): tokens == the sync
    adaptive engine's (greedy and seeded: the target decides them), steps chained, blocks back. (Both engines skip
    the start-up profiles: `unprofiled`, their tables are set here.)"""
    from deepinfer.spec.draft_cost import DraftCostTable
    from deepinfer.spec.scheduler import StepCostTable

    ps = parts[4][:2]
    params = [replace(GREEDY, max_tokens=12, logprobs=None), replace(SEEDED, max_tokens=12)]
    outs = {}
    for mode in (None, True):
        e = make(parts, speculative_method="mtp", num_speculative_tokens=2, speculative_adaptive=True,
                 max_num_batched_tokens=16, max_num_seqs=2, async_scheduling=mode)
        policy = e._spec.policy
        policy.cost = StepCostTable([1, 4096], [0.01, 0.0101])  # verified tokens almost free
        policy.draft_cost = DraftCostTable(2, StepCostTable([1, 64], [1e-4, 1e-4]), StepCostTable([1, 64], [1.0, 1.0]))
        policy.measure_steps = 0
        policy.realized.decides = False
        outs[mode] = ([o.outputs[0].token_ids for o in e.generate(ps, params, use_tqdm=False)], e)
    assert outs[True][0] == outs[None][0]
    on = outs[True][1]
    assert on._spec.num_chained_steps >= 2, on._spec.chain_fallbacks
    assert on.stats().kv_blocks_used == 0 and on._spec._in_flight is None


@pytest.mark.parametrize("kw,why", [
    ({"speculative_method": "ngram"}, "n-gram"),
    ({"enforce_eager": True}, "enforce_eager"),
])
def test_refused_where_steps_cannot_chain(parts, kw, why):  # noqa: F811
    with pytest.raises(ConfigError, match=rf"async_scheduling=True \(--async-scheduling.*{why}"):
        make(parts, **{"speculative_method": "mtp", "num_speculative_tokens": K, "async_scheduling": True, **kw})


def test_refused_without_overlapped_output(parts, monkeypatch):  # noqa: F811
    monkeypatch.setenv("DEEPINFER_SPEC_OVERLAP_OUTPUT", "0")
    with pytest.raises(ConfigError, match=r"async_scheduling=True.*DEEPINFER_SPEC_OVERLAP_OUTPUT"):
        make(parts, speculative_method="mtp", num_speculative_tokens=K, async_scheduling=True)
