"""Structured output with speculative decoding, end to end on the embedded stdlib-coder model (CPU, fp32).

The model drafts code, so its MTP and n-gram drafts hold many tokens a JSON Schema or a regex forbids: the
drafts are cut there (sample/grammar/draft_mask.py), every verified position is drawn under the mask of the
state after the drafts before it, and the output must be what speculation off gives, token for token
(greedy and seeded T > 0, in a batch mixed with unconstrained requests), and valid against its constraint.
Step by step, each constrained sequence's matcher must equal a fresh matcher fed its output.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from deepinfer import EngineConfig, SamplingParams, StructuredOutputsParams
from deepinfer.engine import DeepInferenceEngine
from deepinfer.sample.grammar.bitmask import fill_grammar_mask
from deepinfer.sample.grammar.matcher_state import SeqGrammar

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
}, "required": ["name", "age", "tags"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
PROMPTS = ["# a person record\n", "def parse(x):", "import os\n", "x = ", "class A:"]


def _json(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA, whitespace="compact"),
                          **kw)


def _regex(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=64, structured_outputs=StructuredOutputsParams(regex=REGEX), **kw)


# structured greedy and seeded (T > 0) requests beside unconstrained greedy and seeded ones: one mixed batch
BATCH = [_json(temperature=0.0), _regex(temperature=0.0), _json(temperature=0.8, seed=11),
         SamplingParams(temperature=0.0, max_tokens=24), _regex(temperature=1.0, seed=5),
         SamplingParams(temperature=0.7, seed=3, max_tokens=24)]
KINDS = ["json", "regex", "json", "plain", "regex", "plain"]


def make(parts, **kw) -> DeepInferenceEngine:
    path, backend, model, tok = parts
    settings = {"model_name_or_path": path, "device": "cpu", "dtype": "float32", "max_model_len": 256,
                "num_kv_blocks": 128, "load_progress": False}
    settings.update(kw)
    return DeepInferenceEngine.from_components(EngineConfig(**settings), model, tok, backend)


def _check_valid(kind: str, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", (kind, text, finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("method,grammar", [("mtp", "llguidance"), ("ngram", "llguidance"), ("mtp", "xgrammar")])
def test_structured_with_speculation_equals_off_and_is_valid(parts, method, grammar):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(BATCH))]
    off = make(parts, structured_output_backend=grammar)
    want = off.generate(prompts, BATCH, use_tqdm=False)
    on = make(parts, structured_output_backend=grammar, speculative_method=method, num_speculative_tokens=3)
    got = on.generate(prompts, BATCH, use_tqdm=False)
    for kind, a, b in zip(KINDS, want, got):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, (kind, a.outputs[0].text, b.outputs[0].text)
        if kind != "plain":
            _check_valid(kind, b.outputs[0].text, b.outputs[0].finish_reason)
    st = on.stats()
    assert st.spec_accepted_tokens > 0, st  # drafts were verified and accepted, structured ones included
    assert on._spec.num_grammar_clipped > 0  # the drafter proposed tokens the grammars forbid: cut, not verified
    if method == "mtp":  # a structured request alone gives what it gives in the mixed batch
        alone = on.generate([prompts[0]], [BATCH[0]], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == got[0].outputs[0].token_ids


def _fresh_mask(engine, output: list[int]) -> torch.Tensor:
    comp = engine.grammar_compiler()
    facts = engine.runner.grammar_facts
    fresh = SeqGrammar(comp.matcher(comp.compile(StructuredOutputsParams(json=SCHEMA, whitespace="compact"))))
    mask, failed = fill_grammar_mask([(0, fresh, output, False)], facts, engine.runner.grammar_forbidden)
    assert not failed
    return mask.bitmask[0]


def test_matcher_state_after_every_speculative_step_equals_a_fresh_matcher(parts):
    """Step by step: verified drafts partly rejected, the matcher holds exactly the committed output."""
    eng = make(parts, speculative_method="mtp", num_speculative_tokens=4)
    partial = 0
    steps = 0
    for j, prompt in enumerate(PROMPTS[:3]):  # one request at a time: a step's counts are that request's
        eng.add_request(f"r{j}", prompt, _json(temperature=0.0 if j else 0.9, seed=j))
        while eng.has_unfinished_requests():
            before = eng.stats()
            eng.step()
            steps += 1
            after = eng.stats()
            verified = after.spec_drafted_tokens - before.spec_drafted_tokens
            accepted = after.spec_accepted_tokens - before.spec_accepted_tokens
            partial += 0 < accepted < verified  # some drafts accepted, then one rejected, in this step
            for seq in eng.scheduler.running:
                g = seq.grammar
                assert g.error is None and g.num_accepted <= len(seq.output_token_ids)
                mask, failed = fill_grammar_mask([(0, g, seq.output_token_ids, False)], eng.runner.grammar_facts,
                                                 eng.runner.grammar_forbidden)
                assert not failed and g.num_accepted == len(seq.output_token_ids)
                assert torch.equal(mask.bitmask[0], _fresh_mask(eng, seq.output_token_ids))
            assert steps < 300
    assert partial > 0, "no step had a partial acceptance: the rollback path was not exercised"


def test_a_grammar_error_fails_that_request_only(parts):
    """A matcher in error (what a resource limit of the engine would give) mid-generation: that request
    finishes with "error" and draws nothing more; the others, drafting in the same steps, are unchanged."""
    eng = make(parts, speculative_method="mtp", num_speculative_tokens=3)
    reqs = {"bad": (PROMPTS[0], _json(temperature=0.0)), "ok": (PROMPTS[1], _regex(temperature=0.0)),
            "plain": (PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24))}
    for rid, (prompt, sp) in reqs.items():
        eng.add_request(rid, prompt, sp)
    done = {}
    for _ in range(3):
        done.update({o.request_id: o for o in eng.step() if o.finished})
    seq = next(s for s in eng.scheduler.running if s.request.request_id == "bad")
    held = len(seq.output_token_ids)
    seq.grammar.error = "injected: the matcher failed"
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    bad = done["bad"]
    assert bad.finish_reason == "error" and "injected" in bad.error and len(bad.token_ids) == held
    want = make(parts).generate([reqs["ok"][0], reqs["plain"][0]], [reqs["ok"][1], reqs["plain"][1]], use_tqdm=False)
    assert [done["ok"].token_ids, done["plain"].token_ids] == [w.outputs[0].token_ids for w in want]
    _check_valid("regex", done["ok"].text, done["ok"].finish_reason)


def test_mtp_drafts_are_drawn_under_the_grammar(parts, monkeypatch):
    """spec/grammar_drafts.py: a structured request's MTP drafts are the argmax of the grammar-masked MTP
    distribution, so they are valid and get verified instead of cut at the first forbidden token. Measured here
    (8 JSON / regex requests, greedy, k = 3): tau 2.47 masked vs 1.34 unmasked, drafted tokens cut 11 vs 212. The
    output is the same either way (the test above, and here)."""
    from deepinfer.spec.grammar_drafts import DraftGrammarMask

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    params = [_json(temperature=0.0) if i % 2 == 0 else _regex(temperature=0.0) for i in range(8)]

    def run():
        e = make(parts, speculative_method="mtp", num_speculative_tokens=3)
        outs = e.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], e.stats().spec_tau, e._spec.num_grammar_clipped, \
            e._spec.num_grammar_masked

    tokens, tau, clipped, masked = run()
    monkeypatch.setattr(DraftGrammarMask, "needed", staticmethod(lambda seqs: False))  # the control: unmasked drafts
    tokens_off, tau_off, clipped_off, masked_off = run()
    assert tokens == tokens_off and masked > 0 and masked_off == 0
    assert tau > tau_off + 0.5 and clipped * 4 < clipped_off
