"""Overlapped output (spec/overlap.py): a one-sync step's read-back is the next engine call's, its text made while the
next step runs. On the nvidia backend under the Triton interpreter with the stand-in graph API (the tiny drafting
checkpoint of test_spec_nvidia_interpreter.py, fp32), mtp k = 3: every decode step one-sync.

- call by call, the same outputs as DEEPINFER_SPEC_OVERLAP_OUTPUT=0: test_spec_chained.py (beside the chained
  steps');
- a detokenizer raising in the overlapped text fails that request only; an abort while a step is in flight (an
  overlapped one, or a chained one) drops that request's rows; every block comes back; drain resolves a step in
  flight.
"""

from __future__ import annotations

from dataclasses import replace

from test_spec_mtp_graphs import parts  # noqa: F401 (the module's fixture)
from test_spec_nvidia_interpreter import GREEDY, make

K = 3


def spec_engine(parts, monkeypatch, overlap: bool, **kw):  # noqa: F811
    monkeypatch.setenv("DEEPINFER_SPEC_OVERLAP_OUTPUT", "1" if overlap else "0")
    engine = make(parts, speculative_method="mtp", num_speculative_tokens=K, **kw)
    assert engine._spec.one_sync is not None and engine._spec.overlap == overlap
    return engine


def drive(engine, requests, on_call=None, max_calls: int = 200):
    """add every (rid, prompt, params), step to the end; returns (per-request snapshots in order, calls that
    returned nothing while requests ran). on_call(engine, call) runs before each step."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    snaps: dict[str, list] = {rid: [] for rid, _, _ in requests}
    empty = 0
    for call in range(max_calls):
        if not engine.has_unfinished_requests():
            break
        if on_call is not None:
            on_call(engine, call)
        outs = engine.step()
        empty += not outs
        for o in outs:
            c = o.outputs[0]
            lps = [{t: (lp.logprob, lp.decoded) for t, lp in d.items()} for d in c.logprobs] if c.logprobs else None
            snaps[o.request_id].append((c.text, list(c.token_ids), c.finish_reason, c.stop_reason, lps, o.finished,
                                        o.error))
    assert not engine.has_unfinished_requests()
    return snaps, empty


def test_text_failure_and_abort_in_flight_touch_one_request(parts, monkeypatch):  # noqa: F811
    """r1's detokenizer raises at its 4th token (made in an overlapped text flush): r1 fails with the error named,
    its tokens before it right; r2 is aborted while a step holding its rows is in flight (a chained one, launched on
    the device results of the one before, spec/chained_steps.py: an overlapped step's rows are dropped the same
    way). r0 equals its clean run and every block comes back."""
    chained = True
    ps = parts[4]
    params = replace(GREEDY, max_tokens=14, logprobs=None)
    # (r0's clean run: speculation off, eager, one sequence, which captures no graph; greedy speculation's tokens
    # equal it, test_spec_nvidia_interpreter.py)
    clean, _ = drive(make(parts, enforce_eager=True, max_num_seqs=1), [("r0", ps[0], params)])
    engine = spec_engine(parts, monkeypatch, True, async_scheduling=True if chained else None)
    state = {"aborted": None, "flushes": 0}

    def on_call(e, call):
        if call == 0:
            det = e._requests["r1"].seqs[0].detokenizer
            add, calls = det.add, [0]

            def failing_add(token_id):
                calls[0] += 1
                if calls[0] >= 4:
                    assert e._spec._in_flight is not None  # (the flush overlaps a step in flight)
                    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
                return add(token_id)

            det.add = failing_add
        flight = e._spec._in_flight
        if state["aborted"] is None and flight is not None and call >= 3 and (flight.fields is not None) == chained:
            held = [it.seq.request.request_id for it in flight.sched.scheduled]
            assert "r2" in held
            state["aborted"] = e.abort_request("r2")

    got, _ = drive(engine, [("r0", ps[0], params), ("r1", ps[1], params), ("r2", ps[2], params)], on_call)
    assert got["r0"][-1] == clean["r0"][-1]
    _, ids, reason, _, _, finished, error = got["r1"][-1]
    assert reason == "error" and finished and error.startswith("internal error in request 'r1' while processing its "
                                                                "output: UnicodeDecodeError")
    assert 4 <= len(ids) < 14
    aborted = state["aborted"]
    assert aborted is not None and aborted.outputs[0].finish_reason == "abort"
    assert all(s[1] == aborted.outputs[0].token_ids[: len(s[1])] for s in got["r2"])  # nothing after the abort
    assert engine.stats().kv_blocks_used == 0 and engine._spec._in_flight is None
    assert (engine._spec.num_chained_steps > 0) == chained
    again, _ = drive(engine, [("again", ps[0], params)])  # and the engine goes on serving
    assert again["again"][-1][:4] == clean["r0"][-1][:4]


def test_drain_resolves_a_step_in_flight(parts, monkeypatch):  # noqa: F811
    """drain (the engine's last call, an idle server) resolves the step in flight: its tokens are appended and
    its text made; has_pending says so before."""
    ps = parts[4]
    overlap = True
    engine = spec_engine(parts, monkeypatch, overlap)
    engine.add_request("r", ps[0], replace(GREEDY, max_tokens=14, logprobs=None))
    while engine._spec.metrics.steps < 2:
        engine.step()
    seq = engine._requests["r"].seqs[0]
    n = len(seq.output_token_ids)
    assert engine._spec.has_pending() == overlap
    engine._spec.drain()
    assert not engine._spec.has_pending() and seq.pending_text == []
    assert (len(seq.output_token_ids) > n) == overlap
    assert seq.detokenizer.token_ids == seq.output_token_ids  # (every token's text made)
