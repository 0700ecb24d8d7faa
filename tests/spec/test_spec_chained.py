"""Async scheduling of speculative steps (spec/chained_steps.py): the next one-sync step launched on the device results
of the one in flight. On the nvidia backend under the Triton interpreter with the stand-in graph API (the tiny
drafting checkpoint of test_spec_nvidia_interpreter.py, fp32), mtp static k.

- call by call, the same outputs as the sync engine (async_scheduling off), greedy, seeded and random (engine seed)
  requests (their draws keyed by the device's corrected positions), partial acceptance rolled back,
  a stop string and a stop token landing mid-stream, max_tokens mid-draft, logprobs; the steady steps chained (the
  step in flight when the next launched), every block back;
- the fallbacks: a penalized request, a tight KV cache keep the next step sync (counted by reason), output unchanged;
- an abort and a detokenizer failure with a chained step in flight touch that request only;
- the refusals at start-up (adaptive, n-gram, enforce_eager, overlap off) name the flag and the reason.
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

    for rid in want:
        g, w = got[rid], want[rid]
        same(g[-1], w[-1], rid)
        n = min(len(g), len(w)) - 2
        for a, b in zip(g[:n], w[:n]):
            same(a, b, rid)
        final_ids, final_text = g[-1][1], g[-1][0]
        assert all(x[1] == final_ids[: len(x[1])] and final_text.startswith(x[0]) for x in g), rid


def test_chained_steps_equal_the_sync_engine_call_by_call(parts):  # noqa: F811
    ps = parts[4]
    ref, _ = drive(engine(parts, None), [("g0", ps[0], replace(GREEDY, max_tokens=30))])
    text0 = ref["g0"][-1][0]
    stop = text0[len(text0) // 2: len(text0) // 2 + 2]
    reqs = [("g0", ps[0], replace(GREEDY, max_tokens=30)), ("g1", ps[1], replace(GREEDY, max_tokens=30, logprobs=None)),
            ("g2", ps[2], replace(GREEDY, max_tokens=30)), ("stop", ps[0], replace(GREEDY, max_tokens=30, stop=[stop])),
            ("tok", ps[1], replace(GREEDY, max_tokens=30, stop_token_ids=[ref["g0"][-1][1][6]])),
            ("short", ps[2], replace(GREEDY, max_tokens=7)), ("seeded", ps[2], replace(SEEDED, max_tokens=30)),
            ("random", ps[0], replace(SEEDED, max_tokens=30, seed=None, temperature=0.7, top_k=20))]
    sync = engine(parts, None, max_num_seqs=8, num_kv_blocks=64, seed=11)
    on = engine(parts, True, max_num_seqs=8, num_kv_blocks=64, seed=11)  # (the unseeded request's seed: the engine's)
    history = {"sync": record_verifications(sync), "on": record_verifications(on)}
    want, _ = drive(sync, reqs)
    got, _ = drive(on, reqs)
    assert_same_outputs(got, want)
    # every verification's accepted count and the drafts drafted after it, per request, the same, but the sync
    # engine's last (near max_tokens it verifies fewer drafts) and the chained steps launched after a request's end
    # (dropped); wrong positions or contexts in a chained step's MTP pass or chain change its drafts (its tokens would
    # not show it: the target decides them)
    for rid in want:
        a, b = history["on"][rid], history["sync"][rid]
        n = min(len(a), len(b)) - 1
        assert n >= (1 if rid == "short" else 3) and a[:n] == b[:n], rid
    spec = on._spec
    assert spec.num_chained_steps >= 3, spec.chain_fallbacks
    assert spec.phases.steps["chained"] == spec.num_chained_steps
    a, b = on.stats(), sync.stats()
    assert 0 < b.spec_accepted_tokens < b.spec_drafted_tokens  # partial acceptance: rolled back
    assert a.kv_blocks_used == 0 and spec._in_flight is None


def test_fallbacks_keep_the_output_and_are_counted(parts):  # noqa: F811
    """A request with a repetition penalty beside greedy ones (the penalty counts host tokens: the next step waits
    for the read-back), then a KV cache too small for every worst case (the cover fails: sync; the scheduler
    preempts as it would): output == sync, the fallbacks counted by reason, chaining resumes once the penalized
    request is done."""
    ps = parts[4]
    reqs = [("g0", ps[0], replace(GREEDY, max_tokens=30, logprobs=None)),
            ("s", ps[1], replace(GREEDY, max_tokens=6, repetition_penalty=1.3)),
            ("g2", ps[2], replace(GREEDY, max_tokens=30, logprobs=None))]
    want, _ = drive(engine(parts, None, max_num_seqs=4), reqs)
    on = engine(parts, True, max_num_seqs=4)
    got, _ = drive(on, reqs)
    assert_same_outputs(got, want)
    spec = on._spec
    assert spec.chain_fallbacks.get("sampling", 0) >= 1 and spec.num_chained_steps >= 2, spec.chain_fallbacks
    # 8 blocks of 16 for three sequences of up to ~40 tokens: the worst-case covers run out
    tight = [(rid, p, replace(sp, max_tokens=30, repetition_penalty=1.0) if rid == "s" else sp) for rid, p, sp in reqs]
    want, _ = drive(engine(parts, None, max_num_seqs=4, num_kv_blocks=8), tight)
    small = engine(parts, True, max_num_seqs=4, num_kv_blocks=8)
    got, _ = drive(small, tight)
    assert_same_outputs(got, want)
    assert small._spec.chain_fallbacks.get("kv", 0) >= 1, small._spec.chain_fallbacks
    assert small.stats().kv_blocks_used == 0


def test_abort_and_text_failure_with_a_chained_step_in_flight(parts):  # noqa: F811
    """r2 aborted while a chained step holds its rows; r1's detokenizer raises in an overlapped flush once steps chain:
    each touches its own request; r0 == its clean run; every block back, nothing in flight."""
    ps = parts[4]
    params = replace(GREEDY, max_tokens=30, logprobs=None)
    clean, _ = drive(engine(parts, None), [("r0", ps[0], params)])
    e = engine(parts, True)
    state = {"aborted": None}

    def on_call(eng, call):
        spec = eng._spec
        if call == 0:
            det = eng._requests["r1"].seqs[0].detokenizer
            add = det.add

            def failing_add(token_id):
                if spec.num_chained_steps >= 2:
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
                return add(token_id)

            det.add = failing_add
        if state["aborted"] is None and spec.num_chained_steps >= 1 and spec._in_flight is not None \
                and spec._in_flight.fields is not None:
            state["aborted"] = eng.abort_request("r2")

    got, _ = drive(e, [("r0", ps[0], params), ("r1", ps[1], params), ("r2", ps[2], params)], on_call)
    assert got["r0"][-1][:4] == clean["r0"][-1][:4]
    assert got["r1"][-1][2] == "error" and got["r1"][-1][6].startswith("internal error in request 'r1' while "
                                                                      "processing its output: UnicodeDecodeError")
    aborted = state["aborted"]
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert all(s[1] == aborted.outputs[0].token_ids[: len(s[1])] for s in got["r2"])
    assert e.stats().kv_blocks_used == 0 and e._spec._in_flight is None


@pytest.mark.parametrize("kw,why", [
    ({"speculative_adaptive": True}, "confidence scheduler"),
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
