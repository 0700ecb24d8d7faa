"""One request's failure never fails another (issue 11), sync and async scheduling.

First line: a value the sampler cannot represent is refused by add_request, naming the field
(top_k = 2**63 used to pass validation and raise inside the step, failing every request in
flight). Second line: an exception raised in a step while processing ONE request's rows (its
sampling row, its detokenizer or stop checker) fails that request only: it finishes with
finish_reason "error" and RequestOutput.error set, its blocks are freed, and every other request
produces exactly the tokens it produces alone (greedy on the arithmetic fake model, whose
reference is engine_fakes.reference_next). A failure outside per-request work (the model
forward) still raises out of step().
"""

from __future__ import annotations

import logging
import math

import pytest
from engine_fakes import VOCAB, FakeBackend, FakeCausalLM, reference_next

from deepinfer import EngineConfig, SamplingParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.errors import InvalidRequestError
from deepinfer.sample.sampler import Sampler
from deepinfer.text.tokenizer import Tokenizer

BS = 4
MAX_TOKENS = 9
MODES = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def make(tok_dir, async_scheduling: bool, model=None, **kw) -> DeepInferenceEngine:
    cfg = EngineConfig(model_name_or_path="fake-model", async_scheduling=async_scheduling, max_model_len=128,
                       num_kv_blocks=200, **kw)
    e = DeepInferenceEngine.from_components(cfg, model or FakeCausalLM(), Tokenizer.from_pretrained(tok_dir),
                                            FakeBackend(BS))
    assert e.async_scheduling is async_scheduling
    return e


def prompts_of(lengths):
    return [[(7 * i + 3 * j + 2) % 250 + 5 for j in range(n)] for i, n in enumerate(lengths)]


def expected(prompt, max_tokens=MAX_TOKENS):
    toks, out = list(prompt), []
    while len(out) < max_tokens:
        t = reference_next(toks, None, None)
        out.append(t)
        toks.append(t)
    return out


def greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, "ignore_eos": True, "max_tokens": MAX_TOKENS, **kw})


PROMPTS = prompts_of([3, 6, 2, 9, 5])
VICTIM = 2  # the request that fails (index into PROMPTS)


def run(engine, params, after_add=None):
    """Queue rid r0..r4 with params[i], step to the end; {rid: final RequestOutput}."""
    for i, (p, sp) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", p, sp)
    if after_add is not None:
        after_add(engine)
    final = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert o.request_id not in final, "an output after the request finished"
            if o.finished:
                final[o.request_id] = o
    assert not engine.has_unfinished_requests()
    return final


def check(engine, final, stage: str, exc_name: str):
    """The victim failed with an error naming it and the stage; the others are exactly their solo runs."""
    assert sorted(final) == [f"r{i}" for i in range(len(PROMPTS))]
    for i, p in enumerate(PROMPTS):
        o = final[f"r{i}"]
        if i == VICTIM:
            assert o.finish_reason == "error" and all(c.finish_reason == "error" for c in o.outputs)
            assert o.error is not None
            assert o.error.startswith(f"internal error in request 'r{VICTIM}' while {stage}: {exc_name}")
            assert "Traceback" not in o.error and "\n" not in o.error
            assert o.token_ids == expected(p)[: len(o.token_ids)]  # what it got before failing is right
        else:
            assert o.error is None
            assert o.finish_reason == "length" and o.token_ids == expected(p), f"r{i} was disturbed"
    st = engine.stats()
    assert st.kv_blocks_used == 0 and st.num_running == 0 and st.num_waiting == 0
    assert st.num_requests_finished == len(PROMPTS)
    # and the engine goes on serving
    again = engine.generate(PROMPTS[:2], greedy(), use_tqdm=False)
    assert [o.token_ids for o in again] == [expected(p) for p in PROMPTS[:2]]
    assert engine.stats().kv_blocks_used == 0


# ---------------------------------------------------------------- first line: refused before queuing


@MODES
def test_huge_top_k_is_refused_before_it_reaches_a_step(fake_tokenizer_dir, async_scheduling):
    e = make(fake_tokenizer_dir, async_scheduling)
    e.add_request("good", PROMPTS[0], greedy())
    with pytest.raises(InvalidRequestError, match=r"top_k must be .*\[1, 2147483647\]") as info:
        e.add_request("bad", PROMPTS[1], SamplingParams(temperature=1.0, top_k=2**63))
    assert info.value.param == "top_k"
    outs = []
    while e.has_unfinished_requests():
        outs += [o for o in e.step() if o.finished]
    assert [o.request_id for o in outs] == ["good"] and outs[0].token_ids == expected(PROMPTS[0])
    assert e.stats().kv_blocks_used == 0


@MODES
def test_top_k_beyond_the_vocabulary_means_off(fake_tokenizer_dir, async_scheduling):
    """A valid top_k far above the vocabulary (the sampler clamps it) draws like top_k off."""
    e = make(fake_tokenizer_dir, async_scheduling)
    same = e.generate([PROMPTS[0]] * 4, [SamplingParams(temperature=1.0, top_k=k, seed=5, max_tokens=6, ignore_eos=True)
                                         for k in (2**31 - 1, VOCAB, -1, 0)], use_tqdm=False)
    assert len({tuple(o.token_ids) for o in same}) == 1
    assert e.stats().kv_blocks_used == 0


def test_values_that_need_the_model_are_checked_at_add_request(fake_tokenizer_dir):
    e = make(fake_tokenizer_dir, False)
    outside = r"stop_token_ids holds ids outside the vocabulary \[0, 300\)"
    with pytest.raises(InvalidRequestError, match=outside) as info:
        e.add_request("a", PROMPTS[0], greedy(stop_token_ids=[5, VOCAB]))
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError, match="cover the whole vocabulary") as info:
        e.add_request("b", PROMPTS[0], greedy(stop_token_ids=list(range(VOCAB)), min_tokens=2, ignore_eos=False))
    assert info.value.param == "stop_token_ids"
    # without min_tokens the same ids are fine (they only stop the sequence)
    (o,) = e.generate([PROMPTS[0]], greedy(stop_token_ids=list(range(VOCAB))), use_tqdm=False)
    assert o.finish_reason == "stop" and len(o.token_ids) == 1
    with pytest.raises(InvalidRequestError, match="prompt is not valid Unicode: lone surrogate") as info:
        e.add_request("c", "ab\ud800c", greedy())
    assert info.value.param == "prompt"
    assert not e.has_unfinished_requests() and e.stats().kv_blocks_used == 0


@MODES
@pytest.mark.parametrize("temperature", [1e-30, 1e-6, 0.0])
def test_tiny_temperatures_are_greedy(fake_tokenizer_dir, async_scheduling, temperature):
    e = make(fake_tokenizer_dir, async_scheduling)
    outs = e.generate(PROMPTS, SamplingParams(temperature=temperature, max_tokens=MAX_TOKENS, ignore_eos=True,
                                              logprobs=3), use_tqdm=False)
    ref = e.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
                     use_tqdm=False)
    for o, r, p in zip(outs, ref, PROMPTS):
        assert o.token_ids == r.token_ids == expected(p)
        for step, ref_step in zip(o.outputs[0].logprobs, r.outputs[0].logprobs):
            assert all(math.isfinite(lp.logprob) for lp in step.values())
            assert {t: lp.logprob for t, lp in step.items()} == {t: lp.logprob for t, lp in ref_step.items()}


# ---------------------------------------------------------------- second line: a failure in a step


class RowFailingSampler(Sampler):
    """Raises for the whole batch whenever the victim's row is in it, once it has `at` outputs."""

    def __init__(self, base: Sampler, victim: SamplingParams, at: int):
        super().__init__(base.vocab_size, base.eos_token_ids)
        self.victim, self.at = victim, at
        self.calls = 0

    def sample(self, logits, rows):
        self.calls += 1
        for r in rows:
            if r.params is self.victim and r.num_drawn >= self.at:
                raise ValueError("injected sampler failure")
        return super().sample(logits, rows)


@MODES
@pytest.mark.parametrize("at", [0, 4], ids=["first-token", "mid-stream"])
def test_sampler_failure_for_one_row_fails_that_request_only(fake_tokenizer_dir, async_scheduling, at, caplog):
    e = make(fake_tokenizer_dir, async_scheduling)
    params = [greedy() for _ in PROMPTS]
    e.runner.sampler = RowFailingSampler(e.runner.sampler, params[VICTIM], at)
    with caplog.at_level(logging.ERROR, logger="deepinfer"):
        final = run(e, params)
    check(e, final, "sampling", "ValueError: injected sampler failure")
    assert len(final[f"r{VICTIM}"].token_ids) <= at
    logged = [r for r in caplog.records if f"'r{VICTIM}'" in r.getMessage() and r.exc_info]
    assert logged and "injected sampler failure" in str(logged[0].exc_info[1])


class NoValidation(SamplingParams):
    """Values the validation would refuse, as a bug elsewhere could produce them."""

    def validate(self) -> None:
        return None


@MODES
def test_params_the_sampler_cannot_take_fail_that_request_only(fake_tokenizer_dir, async_scheduling):
    e = make(fake_tokenizer_dir, async_scheduling)
    params = [greedy() for _ in PROMPTS]
    params[VICTIM] = NoValidation(temperature=1.0, top_p=None, max_tokens=MAX_TOKENS, ignore_eos=True)
    final = run(e, params)
    check(e, final, "sampling", "TypeError")
    assert final[f"r{VICTIM}"].token_ids == []


@MODES
@pytest.mark.parametrize("at", [1, 5], ids=["first-token", "mid-stream"])
def test_detokenizer_failure_fails_that_request_only(fake_tokenizer_dir, async_scheduling, at):
    e = make(fake_tokenizer_dir, async_scheduling)

    def break_detokenizer(engine):
        det = engine._requests[f"r{VICTIM}"].seqs[0].detokenizer
        add, calls = det.add, [0]

        def failing_add(token_id):
            calls[0] += 1
            if calls[0] >= at:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer failure")
            return add(token_id)

        det.add = failing_add

    final = run(e, [greedy() for _ in PROMPTS], after_add=break_detokenizer)
    check(e, final, "processing its output", "UnicodeDecodeError")
    assert len(final[f"r{VICTIM}"].token_ids) == at


@MODES
def test_stop_checker_failure_fails_that_request_only(fake_tokenizer_dir, async_scheduling):
    e = make(fake_tokenizer_dir, async_scheduling)
    params = [greedy() for _ in PROMPTS]
    params[VICTIM] = greedy(stop=["\x00never"])

    def break_stop_checker(engine):
        checker = engine._requests[f"r{VICTIM}"].seqs[0].stop_checker
        feed, calls = checker.feed, [0]

        def failing_feed(delta):
            calls[0] += 1
            if calls[0] == 3:
                raise RuntimeError("injected stop checker failure")
            return feed(delta)

        checker.feed = failing_feed

    final = run(e, params, after_add=break_stop_checker)
    check(e, final, "processing its output", "RuntimeError: injected stop checker failure")
    assert len(final[f"r{VICTIM}"].token_ids) == 3


@MODES
def test_one_failing_sequence_fails_its_whole_request(fake_tokenizer_dir, async_scheduling):
    """n = 3: one sequence's failure finishes all three with "error" and frees all their blocks."""
    e = make(fake_tokenizer_dir, async_scheduling)
    params = [greedy() for _ in PROMPTS]
    params[VICTIM] = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=MAX_TOKENS, ignore_eos=True)

    def break_second(engine):
        det = engine._requests[f"r{VICTIM}"].seqs[1].detokenizer

        def failing_add(token_id):
            raise KeyError(token_id)

        det.add = failing_add

    final = run(e, params, after_add=break_second)
    o = final[f"r{VICTIM}"]
    assert [c.finish_reason for c in o.outputs] == ["error"] * 3
    assert o.error.startswith(f"internal error in request 'r{VICTIM}' while processing its output: KeyError")
    for i, p in enumerate(PROMPTS):
        if i != VICTIM:
            assert final[f"r{i}"].token_ids == expected(p) and final[f"r{i}"].error is None
    assert e.stats().kv_blocks_used == 0


@MODES
def test_every_row_failing_fails_each_request_and_the_engine_goes_on(fake_tokenizer_dir, async_scheduling):
    e = make(fake_tokenizer_dir, async_scheduling)
    params = [NoValidation(temperature=1.0, top_p=None, max_tokens=MAX_TOKENS, ignore_eos=True) for _ in PROMPTS]
    final = run(e, params)
    assert all(final[f"r{i}"].finish_reason == "error" and f"'r{i}'" in final[f"r{i}"].error
               for i in range(len(PROMPTS)))
    assert e.stats().kv_blocks_used == 0
    (o,) = e.generate([PROMPTS[0]], greedy(), use_tqdm=False)
    assert o.token_ids == expected(PROMPTS[0])


class FlakyBatchSampler(Sampler):
    """Raises for batches of more than one row only: no single row is to blame."""

    def sample(self, logits, rows):
        if len(rows) > 1:
            raise RuntimeError("batch-level sampler failure")
        return super().sample(logits, rows)


class FailingForward(FakeCausalLM):
    def __init__(self):
        super().__init__()
        self.fail = False

    def forward(self, batch, caches):
        if self.fail:
            raise RuntimeError("injected forward failure")
        return super().forward(batch, caches)


@MODES
def test_failures_outside_one_requests_work_raise_out_of_step(fake_tokenizer_dir, async_scheduling):
    model = FailingForward()
    e = make(fake_tokenizer_dir, async_scheduling, model)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, greedy())
    e.step()
    model.fail = True
    with pytest.raises(RuntimeError, match="injected forward failure"):
        e.step()

    e2 = make(fake_tokenizer_dir, async_scheduling)
    e2.runner.sampler = FlakyBatchSampler(e2.runner.sampler.vocab_size, e2.runner.sampler.eos_token_ids)
    for i, p in enumerate(PROMPTS):
        e2.add_request(f"r{i}", p, greedy())
    with pytest.raises(RuntimeError, match="batch-level sampler failure"):
        e2.step()


def test_no_nan_logprobs_at_the_parameter_bounds(fake_tokenizer_dir):
    """Every bound at once on the engine path: tokens in range, logprobs finite or -inf, never NaN."""
    e = make(fake_tokenizer_dir, False)
    combos = [
        dict(temperature=1e-5, top_k=1), dict(temperature=100.0, top_p=1e-9), dict(temperature=1.0, min_p=1.0),
        dict(temperature=0.7, repetition_penalty=1e-300, frequency_penalty=-2.0, presence_penalty=-2.0),
        dict(temperature=2.0, repetition_penalty=100.0, frequency_penalty=2.0, presence_penalty=2.0, top_k=2**31 - 1),
        dict(temperature=1e-5, repetition_penalty=5e-324, top_p=0.5, min_p=0.5),
    ]
    params = [SamplingParams(max_tokens=6, ignore_eos=True, logprobs=20, seed=i, **kw) for i, kw in enumerate(combos)]
    outs = e.generate([PROMPTS[i % len(PROMPTS)] for i in range(len(combos))], params, use_tqdm=False)
    for o in outs:
        assert o.error is None and o.finish_reason == "length"
        assert all(0 <= t < VOCAB for t in o.token_ids)
        for step in o.outputs[0].logprobs:
            assert not any(math.isnan(lp.logprob) for lp in step.values())
    assert e.stats().kv_blocks_used == 0


@pytest.mark.gpu
def test_isolation_on_cuda_with_async_scheduling(checkpoint):
    """On a real GPU (CUDA graphs, a step in flight while the next is launched): one request's
    sampler failure mid-stream leaves the others' tokens exactly as in a clean run."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    e = DeepInferenceEngine.from_config(EngineConfig(
        model_name_or_path=checkpoint("tiny-v2-lite"), device="cuda", dtype="float32", max_model_len=256,
        num_kv_blocks=64, max_num_seqs=16, load_progress=False, async_scheduling=True))
    assert e.async_scheduling and e.runner.graph_runner is not None
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (5, 17, 40, 9, 64)]

    def params():
        ps = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True) for _ in prompts]
        ps[3] = SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12, ignore_eos=True, logprobs=2)
        return ps

    clean = [o.token_ids for o in e.generate(prompts, params(), use_tqdm=False)]
    ps = params()
    base = e.runner.sampler
    e.runner.sampler = RowFailingSampler(base, ps[VICTIM], at=5)
    try:
        outs = e.generate(prompts, ps, use_tqdm=False)
    finally:
        e.runner.sampler = base
    for i, (o, ref) in enumerate(zip(outs, clean)):
        if i == VICTIM:
            assert o.finish_reason == "error" and "while sampling: ValueError" in o.error
            assert o.token_ids == ref[: len(o.token_ids)] and len(o.token_ids) <= 5
        else:
            assert o.error is None and o.token_ids == ref, i
    assert e.stats().kv_blocks_used == 0
