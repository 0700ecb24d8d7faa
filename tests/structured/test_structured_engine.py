"""Structured output end to end through DeepInferenceEngine (CPU, fp32): outputs obey their constraint,
constrained and plain requests in one async batch equal each alone, errors at add_request, preemption.

The embedded stdlib-coder model (trained) and a tiny random-weight preset both run; with a random model
nearly every token is unlikely, so only the mask can make its output valid (a check that cannot pass
by chance). Schemas bound every length (maxLength, maximum, enum) so greedy output ends within max_tokens.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.errors import InvalidRequestError, StructuredOutputError

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
    "pet": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}},
                                          "required": ["kind"], "additionalProperties": False}]},
}, "required": ["name", "age", "tags", "pet"], "additionalProperties": False}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
LARK = 'start: "(" num (" + " num)* ")"\nnum: /[0-9]{1,3}/'
LARK_EQUIV = r"\((\d{1,3})( \+ \d{1,3})*\)"  # the same language, to check the output independently
EBNF = 'root ::= "(" num (" + " num)* ")"\nnum ::= [0-9] [0-9]? [0-9]?'
CHOICES = ["alpha", "beta", "gamma delta"]


def params(kind: str, engine: str = "llguidance", **kw) -> SamplingParams:
    so = {"json": StructuredOutputsParams(json=SCHEMA, whitespace="compact"),
          "regex": StructuredOutputsParams(regex=REGEX),
          "grammar": StructuredOutputsParams(grammar=LARK if engine == "llguidance" else EBNF),
          "choice": StructuredOutputsParams(choice=CHOICES),
          "json_object": StructuredOutputsParams(json_object=True, whitespace="compact"),
          "plain": None}[kind]
    return SamplingParams(temperature=kw.pop("temperature", 0.0), max_tokens=kw.pop("max_tokens", 96),
                          structured_outputs=so, **kw)


def check(kind: str, text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", (kind, text, finish_reason)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "grammar":
        assert re.fullmatch(LARK_EQUIV, text), text
    elif kind == "choice":
        assert text in CHOICES


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(engine="llguidance", async_scheduling=True, model=None, **kw):
        key = (engine, async_scheduling, model, tuple(sorted(kw.items())))
        if key not in made:
            kw.setdefault("max_model_len", 512)
            made[key] = LLM(model=model, device="cpu", dtype="float32", load_progress=False,
                            max_num_seqs=16, structured_output_backend=engine, async_scheduling=async_scheduling, **kw)
        return made[key]

    return get


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from deepinfer.checkpoints import make_checkpoint

    d = tmp_path_factory.mktemp("tiny_v2_lite_structured")
    make_checkpoint("tiny-v2-lite", str(d), seed=0, progress=False)
    return str(d)


KINDS = ["json", "regex", "grammar", "choice", "json_object"]
PROMPTS = ["def parse(x):", "import os\n", "class A:", "# a person record\n", "x = "]


@pytest.mark.parametrize("engine", ["llguidance", "xgrammar"])
def test_outputs_obey_constraints_mixed_batch_equals_alone(engine, engines):
    """Every kind's output validates; a mixed batch (with plain requests, async scheduling on) gives
    each request exactly the tokens it gets alone; the draws that waited for masks took the deferred
    path, not the resolve-first fallback."""
    llm = engines(engine)
    kinds = KINDS + ["plain", "json"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(kinds))]
    plist = [params(k, engine) for k in kinds]
    plist[-1] = params("json", engine, temperature=0.9, seed=7)  # a sampled row under a mask
    before = llm.stats().num_sync_fallbacks, llm.runner.num_deferred_draws
    together = llm.generate(prompts, plist, use_tqdm=False)
    assert llm.stats().num_sync_fallbacks == before[0]
    assert llm.runner.num_deferred_draws > before[1]
    for kind, out in zip(kinds, together):
        if kind != "plain":
            check(kind, out.outputs[0].text, out.outputs[0].finish_reason)
    for j in (0, 2, 5, 6):  # json, grammar, plain, sampled json: each alone gets the same tokens
        alone = llm.generate([prompts[j]], [plist[j]], use_tqdm=False)[0]
        assert alone.outputs[0].token_ids == together[j].outputs[0].token_ids, kinds[j]


def test_sync_equals_async_and_logprobs_are_masked(engines):
    sync, asy = engines(async_scheduling=False), engines(async_scheduling=True)
    p = params("choice", logprobs=5)
    a = sync.generate(PROMPTS[:2], [p, p], use_tqdm=False)
    b = asy.generate(PROMPTS[:2], [p, p], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    first = a[0].outputs[0].logprobs[0]  # the masked distribution: only choice prefixes have mass
    tok = sync.tokenizer
    for lp in first.values():
        if lp.logprob > float("-inf"):
            assert any(c.startswith(tok.decode([lp.token_id])) for c in CHOICES), lp


def test_random_weight_model(engines, tiny_checkpoint):
    llm = engines(model=tiny_checkpoint)
    kinds = ["json", "regex", "choice", "grammar"]
    outs = llm.generate([PROMPTS[0]] * len(kinds), [params(k, max_tokens=200) for k in kinds], use_tqdm=False)
    for kind, out in zip(kinds, outs):
        check(kind, out.outputs[0].text, out.outputs[0].finish_reason)


def test_errors_at_add_request(engines):
    llm = engines()
    bad = {"uniqueItems": {"type": "array", "uniqueItems": True}, "not": {"not": {"type": "null"}},
           "maxLenght": {"type": "string", "maxLenght": 3}}
    for keyword, schema in bad.items():
        with pytest.raises(StructuredOutputError) as err:
            llm.add_request(f"bad-{keyword}", "x", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        assert err.value.keyword == keyword and err.value.param == "structured_outputs.json"
    with pytest.raises(StructuredOutputError) as err:
        llm.add_request("bad-regex", "x", SamplingParams(structured_outputs=StructuredOutputsParams(regex="(a|b")))
    assert err.value.param == "structured_outputs.regex"
    with pytest.raises(StructuredOutputError, match="over the limit"):
        llm.add_request("big", "x", SamplingParams(structured_outputs=StructuredOutputsParams(
            choice=["x" * 1000] * 300)))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a"))
    assert err.value.param == "ignore_eos"
    assert not llm.has_unfinished_requests()  # nothing was queued


def test_xgrammar_refuses_what_it_would_ignore(engines):
    llm = engines("xgrammar")
    for keyword, schema in {"maxLength": {"type": "string", "pattern": "^a+$", "maxLength": 3},
                            "format": {"type": "string", "format": "email"},
                            "oneOf": {"oneOf": [{"type": "integer"}, {"type": "string"}]}}.items():
        with pytest.raises(StructuredOutputError) as err:
            llm.add_request("x", "x", SamplingParams(structured_outputs=StructuredOutputsParams(json=schema)))
        assert err.value.keyword == keyword


def test_preemption_and_abort_keep_matchers_consistent(engines):
    """Preempted constrained sequences recompute and keep their matcher (their tokens stay): the
    outputs equal an unpreempted run's and validate. An aborted one leaves the others unharmed."""
    roomy = engines()
    tight = engines(num_kv_blocks=7, block_size=16, max_model_len=112)
    prompts = [p * 3 for p in PROMPTS[:4]]
    plist = [params("json", max_tokens=80)] * 4
    ref = roomy.generate(prompts, plist, use_tqdm=False)
    pre = tight.stats().num_preemptions
    got = tight.generate(prompts, plist, use_tqdm=False)
    assert tight.stats().num_preemptions > pre
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        check("json", g.outputs[0].text, g.outputs[0].finish_reason)
    llm = roomy
    llm.add_request("keep", PROMPTS[0], params("regex"))
    llm.add_request("drop", PROMPTS[1], params("json"))
    for _ in range(3):
        llm.step()
    llm.abort_request("drop")
    outs = {}
    while llm.has_unfinished_requests():
        for o in llm.step():
            outs[o.request_id] = o
    check("regex", outs["keep"].outputs[0].text, outs["keep"].outputs[0].finish_reason)
