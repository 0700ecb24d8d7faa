"""Async scheduling (sched/step_pipeline.py) gives exactly the outputs of sync scheduling.

Each test runs the same workload on two engines, async_scheduling=False and True, and
compares everything a caller sees (token ids, text, finish and stop reasons, logprobs,
stats). The arithmetic fake model (engine_fakes.py) reads every token back through the block
tables, so a wrong pending-token input id, a block freed too early or reused while a step
still needs it changes its tokens; `expected` is its reference. On the CPU the forward runs
inside the host's call, so nothing overlaps here: these tests check the bookkeeping (pending
tokens, dropped tokens, fallbacks), not the speed.
"""

from __future__ import annotations

import pytest
from engine_fakes import FakeBackend, FakeCausalLM, reference_next

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.text.tokenizer import Tokenizer

BS = 4
EOS = 1  # the fake tokenizer's eos id (tokenizer_factory: bos 0, eos 1)
GREEDY = dict(temperature=0.0, ignore_eos=True)


def make(tok_dir, async_scheduling: bool, model=None, **kw) -> DeepInferenceEngine:
    cfg = EngineConfig(model_name_or_path="fake-model", async_scheduling=async_scheduling, **kw)
    return DeepInferenceEngine.from_components(cfg, model or FakeCausalLM(), Tokenizer.from_pretrained(tok_dir),
                                               FakeBackend(BS))


def prompts_of(lengths, salt=0):
    return [[(7 * i + 3 * j + 2 + salt) % 250 + 5 for j in range(n)] for i, n in enumerate(lengths)]


def expected(prompt, max_tokens, model=None, stop_ids=()):
    toks, out = list(prompt), []
    while len(out) < max_tokens:
        t = reference_next(toks, model.window if model else None, model.m if model else None)
        out.append(t)
        toks.append(t)
        if t in stop_ids:
            break
    return out


def snapshot(outs):
    """Everything a RequestOutput tells the caller, as plain data."""
    rows = []
    for o in outs:
        comps = []
        for c in o.outputs:
            lps = None if c.logprobs is None else [
                {t: (lp.logprob, lp.rank, lp.decoded) for t, lp in d.items()} for d in c.logprobs]
            comps.append((c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason, lps))
        rows.append((o.request_id, o.finished, comps))
    return rows


def both(tok_dir, run, model_kw=None, **kw):
    """run(engine) on a sync and an async engine; returns (sync result, async result, async engine)."""
    res = []
    engines = []
    for a in (False, True):
        e = make(tok_dir, a, FakeCausalLM(**(model_kw or {})), **kw)
        assert e.async_scheduling is a
        res.append(run(e))
        engines.append(e)
    for e in engines:
        st = e.stats()
        assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
        assert not e.has_unfinished_requests()
    s0, s1 = engines[0].stats(), engines[1].stats()
    assert (s0.generation_tokens_total, s0.prompt_tokens_total, s0.num_requests_finished) == \
        (s1.generation_tokens_total, s1.prompt_tokens_total, s1.num_requests_finished)
    return res[0], res[1], engines[1]


def test_greedy_and_seeded_mixed_lengths_are_identical(fake_tokenizer_dir):
    prompts = prompts_of([1, 2, 5, 9, 13, 17, 23, 4, 30, 6])
    params = [SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True,
                             **(dict(temperature=0.0) if i % 2 else dict(temperature=4.0, seed=100 + i, top_k=50)))
              for i in range(len(prompts))]
    sync, asy, e = both(fake_tokenizer_dir, lambda e: snapshot(e.generate(prompts, params, use_tqdm=False)),
                        max_model_len=128, num_kv_blocks=200)
    assert sync == asy
    for i, (p, row) in enumerate(zip(prompts, sync)):
        if i % 2:
            assert row[2][0][2] == expected(p, 3 + 2 * i)
    assert any(row[2][0][2] != expected(p, len(row[2][0][2])) for p, row in zip(prompts, sync))  # sampled rows
    assert e.stats().num_sync_fallbacks == 0  # every step overlapped the previous one


@pytest.mark.parametrize("window", [None, 5], ids=["full", "swa"])
def test_chunked_prefill_small_budget(fake_tokenizer_dir, window):
    prompts = prompts_of([1, 2, 5, 9, 13, 17, 23, 4])
    model = FakeCausalLM(window=window)

    def run(e):
        outs = e.generate(prompts, SamplingParams(max_tokens=11, **GREEDY), use_tqdm=False)
        assert all(sum(c) <= 7 for c in e.model.calls)
        assert any(len(c) > 1 and max(c) > 1 and 1 in c for c in e.model.calls)  # decodes mixed with a chunk
        return snapshot(outs)

    sync, asy, _ = both(fake_tokenizer_dir, run, dict(window=window), max_num_batched_tokens=7, max_model_len=128,
                        num_kv_blocks=200)
    assert sync == asy
    assert [r[2][0][2] for r in sync] == [expected(p, 11, model) for p in prompts]


def test_stops_eos_min_tokens_max_tokens(fake_tokenizer_dir):
    # prompts whose greedy continuation hits EOS early, and others for stop ids / min_tokens
    eos_prompts = [p for p in (prompts_of([3, 4, 5, 6], salt=s)[s % 4] for s in range(400))
                   if EOS in expected(p, 12)[2:]][:3]
    assert len(eos_prompts) == 3
    free = prompts_of([5, 8, 11])
    stop_tok = [expected(p, 12)[4] for p in free]
    prompts = eos_prompts + free * 3
    params = ([SamplingParams(temperature=0.0, max_tokens=12)] * 3
              + [SamplingParams(max_tokens=12, stop_token_ids=[t], **GREEDY) for t in stop_tok]
              + [SamplingParams(max_tokens=12, stop_token_ids=[t], min_tokens=6, **GREEDY) for t in stop_tok]
              + [SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True) for k in (1, 2, 7)])
    sync, asy, _ = both(fake_tokenizer_dir, lambda e: snapshot(e.generate(prompts, params, use_tqdm=False)),
                        max_model_len=128, num_kv_blocks=200)
    assert sync == asy
    reasons = [r[2][0][3] for r in sync]
    assert reasons[:3] == ["stop"] * 3 and [r[2][0][2][-1] for r in sync[:3]] == [EOS] * 3
    assert reasons[3:6] == ["stop"] * 3 and reasons[-3:] == ["length"] * 3
    assert [len(r[2][0][2]) for r in sync[-3:]] == [1, 2, 7]
    for p, t, row in zip(free, stop_tok, sync[3:6]):
        assert row[2][0][2] == expected(p, 12, stop_ids=(t,)) and row[2][0][4] == t


def test_stop_strings_text_and_logprobs_on_a_real_checkpoint(checkpoint):
    """Text, stop strings and logprobs on a tiny real model (its tokenizer), sync vs async."""
    path = checkpoint("tiny-v2-lite")
    prompts = ["The weather today", "Hello", "a much longer prompt with several words in it", "q"]
    engines = [DeepInferenceEngine.from_config(EngineConfig(
        model_name_or_path=path, device="cpu", max_model_len=128, num_kv_blocks=64, load_progress=False,
        async_scheduling=a)) for a in (False, True)]
    (free,) = engines[0].generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                                  use_tqdm=False)
    engines[1].generate(prompts[:1], SamplingParams(max_tokens=1), use_tqdm=False)  # same request counter
    stop = free.text[len(free.text) // 2:][:3]
    assert len(free.text) > 8 and stop
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop], logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=10, logprobs=3),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[free.token_ids[5]],
                             min_tokens=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, n=3)]
    outs = [snapshot(e.generate(prompts, params, use_tqdm=False)) for e in engines]
    assert outs[0] == outs[1]
    assert outs[0][0][2][0][3] == "stop" and outs[0][0][2][0][4] == stop
    assert engines[1]._pipeline.num_sync_fallbacks == 0  # logprobs need no fallback


def test_preemption_in_a_tiny_kv_pool(fake_tokenizer_dir):
    prompts = prompts_of([3, 7, 11, 5, 9, 14])
    model = FakeCausalLM(window=6)

    def run(e):
        outs = e.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
        assert e.stats().num_preemptions > 0
        return snapshot(outs)

    sync, asy, e = both(fake_tokenizer_dir, run, dict(window=6), max_num_batched_tokens=16, max_model_len=48,
                        num_kv_blocks=12, max_num_seqs=6)
    assert sync == asy
    assert [r[2][0][2] for r in sync] == [expected(p, 20, model) for p in prompts]
    assert e._pipeline.num_sync_fallbacks > 0  # the pool ran short: resolved before scheduling


def test_preemption_with_a_step_in_flight_is_still_correct(fake_tokenizer_dir, monkeypatch):
    """Without the resolve-first fallback, the scheduler preempts sequences whose token is still
    pending (their blocks are freed while the step in flight writes them): outputs stay right."""
    prompts = prompts_of([3, 7, 11, 5, 9, 14])
    model = FakeCausalLM()
    e = make(fake_tokenizer_dir, True, model, max_num_batched_tokens=16, max_model_len=48, num_kv_blocks=12,
             max_num_seqs=6)
    monkeypatch.setattr(e.scheduler, "would_preempt", lambda: False)
    pending_victims = []
    preempt = e.scheduler._preempt

    def spy(seq):
        pending_victims.append(seq.num_pending)
        preempt(seq)

    monkeypatch.setattr(e.scheduler, "_preempt", spy)
    outs = e.generate(prompts, SamplingParams(max_tokens=20, **GREEDY), use_tqdm=False)
    assert any(pending_victims)  # some victims had a token in flight
    assert [o.token_ids for o in outs] == [expected(p, 20, model) for p in prompts]
    assert e.stats().kv_blocks_used == 0 and e._pipeline.num_sync_fallbacks == 0


def test_n_greater_than_one_and_penalties(fake_tokenizer_dir):
    prompts = prompts_of([4, 9, 2])
    params = [SamplingParams(n=3, temperature=3.0, seed=11, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.5,
                             frequency_penalty=0.7),
              SamplingParams(n=2, temperature=2.0, seed=5, max_tokens=7, ignore_eos=True, presence_penalty=1.0)]
    sync, asy, e = both(fake_tokenizer_dir, lambda e: snapshot(e.generate(prompts, params, use_tqdm=False)),
                        max_model_len=128, num_kv_blocks=200)
    assert sync == asy
    assert len({tuple(c[2]) for c in sync[0][2]}) > 1
    assert e.stats().num_sync_fallbacks > 0  # penalties need the last token on the host


def _collect(e, outs, finals):
    for o in e.step():
        outs.setdefault(o.request_id, []).append(snapshot([o])[0])
        if o.finished:
            finals[o.request_id] = snapshot([o])[0]


def test_abort_mid_run_frees_blocks_and_a_freed_block_is_reused(fake_tokenizer_dir):
    """Abort a request while a step holding it is in flight; a new prefill then reuses its blocks
    (the pool is tiny) and still reads correct KV (stream order: the dropped step ran first)."""
    model = FakeCausalLM()
    e = make(fake_tokenizer_dir, True, model, max_model_len=24, num_kv_blocks=6, max_num_seqs=4)
    a, b = prompts_of([9, 5])
    e.add_request("a", a, SamplingParams(max_tokens=14, **GREEDY))
    e.add_request("b", b, SamplingParams(max_tokens=6, **GREEDY))
    outs, finals = {}, {}
    for _ in range(4):
        _collect(e, outs, finals)
    pending = e._pipeline.pending
    seq_a = e._requests["a"].seqs[0]
    assert pending is not None and any(it.seq is seq_a for it in pending.sched.scheduled)
    a_blocks = set(e.kv.block_table(seq_a.seq_id, "full"))
    aborted = e.abort_request("a")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    a_tokens = aborted.outputs[0].token_ids
    assert a_tokens == expected(a, len(a_tokens))
    c = prompts_of([14], salt=3)[0]
    e.add_request("c", c, SamplingParams(max_tokens=8, **GREEDY))
    c_blocks = set()
    while e.has_unfinished_requests():
        _collect(e, outs, finals)
        seqs = e._requests["c"].seqs if "c" in e._requests else []
        if seqs and e.kv.has(seqs[0].seq_id):
            c_blocks |= set(e.kv.block_table(seqs[0].seq_id, "full"))
    assert c_blocks & a_blocks  # c's prefill reused blocks a held while its step was in flight
    assert all(o[2][0][3] != "abort" for o in outs.get("a", []))  # no output for a after the abort ...
    assert all(len(o[2][0][2]) <= len(a_tokens) for o in outs.get("a", []))  # ... and never its dropped token
    assert finals["b"][2][0][2] == expected(b, 6) and finals["c"][2][0][2] == expected(c, 8)
    st = e.stats()
    assert st.kv_blocks_used == 0 and st.num_state_slots_used == 0 and not e.has_unfinished_requests()


def test_finished_sequence_extra_token_is_dropped(fake_tokenizer_dir):
    """A sequence that stops at step N is already in step N+1: that token never shows up."""
    p = prompts_of([6])[0]
    ref = expected(p, 12)
    stop = ref[3]
    e = make(fake_tokenizer_dir, True, max_model_len=64, num_kv_blocks=40)
    e.add_request("s", p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[stop]))
    e.add_request("long", prompts_of([3])[0], SamplingParams(max_tokens=10, **GREEDY))
    seen = []
    in_flight_when_finished = None
    while e.has_unfinished_requests():
        for o in e.step():
            if o.request_id == "s":
                seen.append(list(o.outputs[0].token_ids))
                if o.finished:
                    pending = e._pipeline.pending
                    in_flight_when_finished = pending is not None and any(
                        it.seq.request.request_id == "s" for it in pending.sched.scheduled)
    assert in_flight_when_finished  # step N+1 had been launched with it
    k = ref.index(stop)
    assert seen[-1] == ref[: k + 1] and all(s == ref[: len(s)] for s in seen)
    assert [len(s) for s in seen] == list(range(1, k + 2))  # one output per token, none after the stop
    assert e.stats().generation_tokens_total == k + 1 + 10


def test_streaming_outputs_lag_one_step_and_drain(fake_tokenizer_dir):
    model = FakeCausalLM()
    e = make(fake_tokenizer_dir, True, model, max_model_len=64, num_kv_blocks=40)
    e.add_request("x", prompts_of([5])[0], SamplingParams(max_tokens=4, **GREEDY))
    assert e.step() == []  # step 1 launched (prefill), nothing resolved yet
    assert e.has_unfinished_requests()
    lengths = []
    while e.has_unfinished_requests():
        lengths += [len(o.outputs[0].token_ids) for o in e.step()]
    assert lengths == [1, 2, 3, 4]
    assert e._pipeline.pending is None and e.stats().kv_blocks_used == 0
    # no wasted forward: a sequence whose pending token reaches max_tokens is not scheduled again
    assert model.calls == [[5], [1], [1], [1]]


def test_cli_flag_maps_onto_the_config():
    import argparse

    from deepinfer.entrypoints.cli_args import engine_config_from_args
    from deepinfer.entrypoints.cli_serve import add_serve_arguments

    p = add_serve_arguments(argparse.ArgumentParser())
    got = [engine_config_from_args(p.parse_args(["m", *a])).async_scheduling
           for a in ([], ["--async-scheduling"], ["--no-async-scheduling"])]
    assert got == [None, True, False]


def test_state_models_run_sync_and_config(fake_tokenizer_dir, monkeypatch):
    monkeypatch.delenv("DEEPINFER_ASYNC_SCHEDULING", raising=False)
    e = make(fake_tokenizer_dir, True, FakeCausalLM(window=6, m=3), max_model_len=64, num_kv_blocks=40)
    assert e.async_scheduling is False  # per-sequence state (V4-like): always sync
    assert make(fake_tokenizer_dir, None, max_model_len=64, num_kv_blocks=40).async_scheduling is False  # CPU: auto off
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "1")
    assert make(fake_tokenizer_dir, None, max_model_len=64, num_kv_blocks=40).async_scheduling is True
    assert make(fake_tokenizer_dir, False, max_model_len=64, num_kv_blocks=40).async_scheduling is False
    monkeypatch.setenv("DEEPINFER_ASYNC_SCHEDULING", "maybe")
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="DEEPINFER_ASYNC_SCHEDULING"):
        make(fake_tokenizer_dir, None, max_model_len=64, num_kv_blocks=40)
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(model_name_or_path="m", async_scheduling="on")
