"""Speculative decoding end to end on the embedded stdlib-coder model (CPU, fp32, its trained MTP module).

Every check compares the engine with speculation on against the same engine with it off, on the same
weights: the output must not change (greedy token for token; seeded sampling draw for draw), whatever
the draft length, the confidence scheduler, stop rules landing inside an accepted run, preemption or
prefix-cache hits on blocks written by verification steps. The acceptance the engine reports must be
that of a working drafter on code (the module measured 71% first-draft acceptance in training).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer
from benchmarks.spec_host import PricedStepTimes
from deepinfer import EngineConfig, SamplingParams
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.engine import DeepInferenceEngine
from deepinfer.models.registry import load_model
from deepinfer.spec.scheduler import StepCostTable
from deepinfer.spec.step_times import SPECULATIVE
from deepinfer.text.tokenizer import Tokenizer

PROMPTS = [
    "def fibonacci(n):\n",
    "import os\n\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n",
    "def parse_args(argv):\n    parser = ",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32)
# step costs of a big model on a memory-bound device (a verified token costs ~nothing more, drafting is cheap
# beside a step): the confidence scheduler admits drafts. The table the engine profiles on this CPU for the
# tiny model is compute-bound, and there it admits none (test below). Ten seconds a step: the admission also
# adds the measured (wall-clock) drafting time, ~0.1 s per step on a loaded 2-core box, which beside a 0.1 s
# step stopped the drafting and made this test depend on the machine's load.
FLAT = StepCostTable([1, 4096], [10.0, 10.1])


def make(parts, **kw) -> DeepInferenceEngine:
    path, backend, model, tok = parts
    settings = dict(model_name_or_path=path, device="cpu", dtype="float32", max_model_len=512, num_kv_blocks=256,
                    load_progress=False)
    settings.update(kw)
    return DeepInferenceEngine.from_components(EngineConfig(**settings), model, tok, backend)


@pytest.fixture(scope="module")
def off(parts):
    return make(parts)


def ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("kw", [dict(num_speculative_tokens=1), dict(num_speculative_tokens=3),
                                dict(num_speculative_tokens=3, speculative_adaptive=True)],
                         ids=["k1", "k3", "adaptive"])
def test_greedy_equals_off_and_reports_acceptance(parts, off, kw):
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)
    want = off.generate(PROMPTS, params, use_tqdm=False)
    on = make(parts, speculative_method="mtp", **kw)
    if kw.get("speculative_adaptive"):
        on._spec.policy.cost = FLAT  # as on a memory-bound device, so the scheduler admits drafts
        on._spec.policy.realized.decides = False  # (the CPU's measured rates would overrule that stand-in)
    got = on.generate(PROMPTS, params, use_tqdm=False)
    assert ids(got) == ids(want)
    for a, b in zip(want, got):  # the verify forward and the decode forward differ only in fp32 rounding
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < 1e-3
    st = on.stats()
    k = kw["num_speculative_tokens"]
    assert st.spec_method == "mtp" and len(st.spec_conditional_acceptance) == k
    assert st.generation_tokens_total == sum(len(t) for t in ids(want))
    assert st.spec_acceptance_rate > 0.3, st
    assert st.spec_tau > 1.3, st  # fewer steps than tokens: drafts were accepted
    assert 0 < st.spec_mean_budget <= k * len(PROMPTS)


def test_reading_stats_mid_run_leaves_the_deferred_bookkeeping_to_the_step(parts):
    """EngineStats read between steps (the server does after every step, a parallel engine's tp rank 0 too) does not
    run the speculative pipeline's deferred work (metrics, calibration, the adaptive policy's observations): a step
    runs it while it waits for the device, and on every rank at the same point. The metrics are complete once the
    engine idles, after its last step or the abort of its last request."""
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3, speculative_adaptive=True)
    on._spec.policy.cost = FLAT
    on._spec.policy.realized.decides = False
    params = SamplingParams(temperature=0.0, max_tokens=12)
    for i, prompt in enumerate(PROMPTS[:2]):
        on.add_request(f"r{i}", prompt, params)
    pending = 0
    while on.has_unfinished_requests():
        on.step()
        if on.has_unfinished_requests() and on._spec._deferred:
            before = len(on._spec._deferred)
            on.stats()
            assert len(on._spec._deferred) == before  # still the next step's
            pending += 1
    assert pending > 0 and not on._spec._deferred  # idle: run
    st = on.stats()
    assert st.spec_steps > 0 and st.generation_tokens_total == 24
    on.add_request("a", PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=50))
    for _ in range(4):
        on.step()
    assert on._spec._deferred
    on.abort_request("a")
    assert not on._spec._deferred and on.stats().spec_steps > st.spec_steps  # the abort left it idle: run


def test_seeded_sampling_is_reproducible_and_equals_off(parts, off):
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=32, seed=11)
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    first = ids(on.generate(PROMPTS, params, use_tqdm=False))
    assert ids(on.generate(PROMPTS, params, use_tqdm=False)) == first
    # the emitted token at each position is the sampler's own keyed draw there (spec/pipeline.py)
    assert first == ids(off.generate(PROMPTS, params, use_tqdm=False))
    assert on.stats().spec_accepted_tokens > 0


def test_stop_strings_and_max_tokens_inside_an_accepted_run(parts, off):
    on = make(parts, speculative_method="mtp", num_speculative_tokens=4)
    ref = off.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    for r, prompt in zip(ref, PROMPTS[:2]):
        text = r.outputs[0].text
        for start in (3, 9, 17):  # stop strings ending at several places of the output
            stop = text[start : start + 3]
            p = SamplingParams(temperature=0.0, max_tokens=32, stop=[stop])
            a, b = off.generate([prompt], p, use_tqdm=False)[0], on.generate([prompt], p, use_tqdm=False)[0]
            assert (b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason, b.outputs[0].stop_reason) \
                == (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason, a.outputs[0].stop_reason)
            assert b.outputs[0].finish_reason == "stop"
    for n in (1, 2, 5, 6, 9):
        p = SamplingParams(temperature=0.0, max_tokens=n)
        got = on.generate(PROMPTS, p, use_tqdm=False)
        assert ids(got) == [t[:n] for t in ids(ref + off.generate(PROMPTS[2:], GREEDY, use_tqdm=False))]
        assert all(o.outputs[0].finish_reason == "length" for o in got)
    assert on.stats().spec_accepted_tokens > 0


def test_preemption_with_speculation(parts, off):
    """A cache of 10 blocks of 16 tokens cannot hold four sequences of ~45 tokens: sequences are preempted
    (their drafts dropped, recomputed) and the output does not change."""
    params = SamplingParams(temperature=0.0, max_tokens=40)
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3, num_kv_blocks=10, max_model_len=128)
    got = on.generate(PROMPTS, params, use_tqdm=False)
    assert on.stats().num_preemptions > 0
    assert ids(got) == ids(off.generate(PROMPTS, params, use_tqdm=False))
    assert on.stats().kv_blocks_used == 0  # every block (drafts' lookahead included) returned


def test_prefix_cache_hits_on_blocks_written_by_verification(parts, off):
    """Prompts = a first request's prompt + its generated tokens hit blocks whose KV was written by
    verification steps (rolled back past rejected drafts). The first request ends exactly at a block
    boundary, where a block keyed one token too early would hold a rejected draft's (or no) KV at its last
    position. Every follow-up's tokens and logprobs equal the reference's."""
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3, enable_prefix_caching=True)
    tok = parts[3]
    params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=1)
    hits = 0
    for text in PROMPTS:
        prompt = tok.encode(text)
        first = on.generate([prompt], SamplingParams(temperature=0.0, max_tokens=64 - len(prompt)),
                            use_tqdm=False)[0].outputs[0].token_ids
        for n in (len(first), 40 - len(prompt)):
            follow = prompt + first[:n] + [first[0]]
            before = on.stats().prefix_cache_hit_tokens
            got = on.generate([follow], params, use_tqdm=False)[0].outputs[0]
            hits += on.stats().prefix_cache_hit_tokens - before
            want = off.generate([follow], params, use_tqdm=False)[0].outputs[0]
            assert got.token_ids == want.token_ids
            for la, lb, t in zip(want.logprobs, got.logprobs, want.token_ids):
                assert abs(la[t].logprob - lb[t].logprob) < 1e-3
    # the 48 + 32 tokens of full, verified blocks were hit per prompt; the block ending at the first request's
    # last token is not keyed (that token's KV was never computed)
    assert hits == 4 * (48 + 32)


def test_batch_invariant_speculation_is_bitwise_equal_to_off():
    """The product's promise: with batch invariance on, speculation changes no token and no logprob bit."""
    path = deepinfer.embedded_model_path()
    backend = CPUBackend()
    backend.enable_batch_invariance()
    model = load_model(path, backend, torch.float32, progress=False, load_mtp=True)
    bi = (path, backend, model, Tokenizer.from_pretrained(path))
    base = make(bi, batch_invariant=True)
    on = make(bi, batch_invariant=True, speculative_method="mtp", num_speculative_tokens=3, speculative_adaptive=True)
    on._spec.policy.cost = FLAT
    on._spec.policy.realized.decides = False  # the stand-in tables plan, not the CPU's measured rates
    for params in (SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
                   SamplingParams(temperature=0.8, max_tokens=24, logprobs=2, seed=5)):
        a, b = base.generate(PROMPTS, params, use_tqdm=False), on.generate(PROMPTS, params, use_tqdm=False)
        assert ids(a) == ids(b)
        for x, y in zip(a, b):
            for la, lb in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
                assert [(t, v.logprob, v.rank) for t, v in la.items()] == \
                    [(t, v.logprob, v.rank) for t, v in lb.items()]
    assert on.stats().spec_accepted_tokens > 0


def test_adaptive_stops_speculating_where_the_cost_model_says_it_does_not_pay(parts, off):
    """With step costs that grow with every verified token (a compute-bound device, such as this CPU on the
    tiny model) the confidence scheduler admits no drafts and pauses drafting: the engine runs plain decode
    steps, probing again (one step verifying the full drafts) every probe_every steps, after the measure_steps
    drafting steps that measure the load first, and measuring again for a few steps where a pause ends
    (SlotPolicy); every plan the model makes is a pause; the output is unchanged."""
    on = make(parts, speculative_method="mtp", num_speculative_tokens=3, speculative_adaptive=True)
    on._spec.policy.cost = StepCostTable([1, 2, 4096], [0.010, 0.020, 40.0])
    # the tables decide, as the docstring says: this CPU's measured step times and realized rates (a chain of 1 at
    # ~0.9-1.0x of plain decoding here, inside the pause margin) move with the machine's load, and under a CI run's
    # load they made it draft on in some runs (chains of 1 to 3)
    on._spec.policy.step_times = PricedStepTimes()  # every step observed at its table price
    on._spec.policy.realized.decides = False
    params = SamplingParams(temperature=0.0, max_tokens=64)
    assert ids(on.generate(PROMPTS[:2], params, use_tqdm=False)) == ids(off.generate(PROMPTS[:2], params,
                                                                                     use_tqdm=False))
    st = on.stats()
    policy = on._spec.policy
    probes = 1 + st.spec_steps // policy.min_probe_every
    decisions = policy.decisions
    assert not any(d.startswith("chain") for d in decisions) and decisions["pause"] >= 1, decisions
    drafting = probes + policy.measure_steps + decisions.get("remeasure", 0)  # the only drafting steps
    # 64 tokens each for two sequences: ~64 steps, fewer by what the probes' and measuring steps' drafts emitted
    assert st.spec_steps > 40 and 0 < st.spec_drafted_tokens <= 3 * 2 * drafting
    assert decisions["paused"] > st.spec_steps / 2 and st.spec_mean_budget < 3 * 2 * drafting / st.spec_steps
    assert policy.step_times.seen(SPECULATIVE, 2) and policy.pause_bucket == 2


def test_ngram_drafts_equal_off_with_accepted_copies(parts, off):
    """Prompt lookup (no model work to draft): a prompt that repeats itself gets drafts copied from its
    earlier occurrences; greedy output equals off's."""
    prompt = "def add(a, b):\n    return a + b\n\n\ndef add(a, b):\n    return a + b\n\n\ndef add("
    params = SamplingParams(temperature=0.0, max_tokens=40)
    on = make(parts, speculative_method="ngram", num_speculative_tokens=3)
    assert ids(on.generate([prompt] + PROMPTS[:1], params, use_tqdm=False)) == \
        ids(off.generate([prompt] + PROMPTS[:1], params, use_tqdm=False))
    st = on.stats()
    assert st.spec_method == "ngram" and st.spec_accepted_tokens > 0 and st.spec_tau > 1.0


def test_penalties_min_tokens_n_and_max_model_len_with_speculation(parts):
    """Each verified position is sampled with the drafts before it as its context (penalties read them, the
    min-tokens mask counts them); n > 1 sequences draft independently; the accepted run stops at max_model_len."""
    off48, on48 = make(parts, max_model_len=48), make(parts, max_model_len=48, speculative_method="mtp",
                                                      num_speculative_tokens=4)
    prompts = PROMPTS[:2]
    for params in (SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.3, frequency_penalty=0.5,
                                  max_tokens=24),
                   SamplingParams(temperature=0.0, min_tokens=20, max_tokens=24, stop_token_ids=[13]),
                   SamplingParams(temperature=0.9, seed=4, n=2, max_tokens=16),
                   SamplingParams(temperature=0.0, max_tokens=None)):
        a, b = off48.generate(prompts, params, use_tqdm=False), on48.generate(prompts, params, use_tqdm=False)
        assert [[x.token_ids for x in o.outputs] for o in a] == [[x.token_ids for x in o.outputs] for o in b]
    assert all(len(p.prompt_token_ids) + len(p.outputs[0].token_ids) == 48 for p in b)  # max_model_len reached
    assert on48.stats().spec_accepted_tokens > 0
