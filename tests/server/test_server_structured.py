"""Structured output and tools through the official `openai` client (a random-weight model: whatever
it would write, the grammar makes the answer valid).

- response_format json_schema (strict), guided_json, structured_outputs json: every output validates
  with `jsonschema`; regex outputs fullmatch; a Lark grammar's outputs parse; choice / json_object hold;
- fail closed: an unenforceable or unknown keyword, two constraint fields, an unknown option: 400
  naming the field (and the keyword);
- tools: `required` / a named function always give calls whose arguments validate against the
  function's parameters (non-streamed and streamed, finish_reason "tool_calls"), `none` hides the
  tools from the prompt, bad tool requests are 400s.
"""

from __future__ import annotations

import ast
import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest
from server_harness import make_engine, start_server
from structured_harness import SCHEMAS, TOOLS, check_calls, join_stream, tool_checkpoint

USER = [{"role": "user", "content": "Answer."}]

JSON_SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 50},
                                      "ok": {"type": "boolean"}}, "required": ["n", "ok"], "additionalProperties": False},
    {"type": "array", "items": {"enum": ["red", "green", 3]}, "minItems": 2, "maxItems": 3},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
     "required": ["code"], "additionalProperties": False},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "null"}, {"const": "x"}]},
                                      "w": {"type": "string", "minLength": 1, "maxLength": 4}},
     "required": ["v", "w"], "additionalProperties": False},
    {"$defs": {"pt": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["x"], "additionalProperties": False}},
     "type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 2},
]


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    live = start_server(make_engine(tool_checkpoint(tiny_checkpoint, tmp_path_factory)), served_model_name="tiny",
                        json_whitespace="compact")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="x", max_retries=0)


def _chat(served, **kwargs):
    async def main():
        async with openai.AsyncOpenAI(base_url=served.v1, api_key="x", max_retries=0) as c:
            return await asyncio.gather(*(c.chat.completions.create(model="tiny", messages=USER, temperature=0,
                                                                    max_tokens=120, **kw) for kw in kwargs["each"]))
    return asyncio.run(main())


def test_json_schema_outputs_validate(served, client):
    formats = [{"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": s, "strict": True}}
               for i, s in enumerate(JSON_SCHEMAS)]
    answers = _chat(served, each=[{"response_format": f} for f in formats])
    for schema, r in zip(JSON_SCHEMAS, answers):
        assert r.choices[0].finish_reason == "stop", r
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # the same schemas through guided_json (completions) and structured_outputs (chat), sampled
    for schema in JSON_SCHEMAS[:2]:
        r = client.completions.create(model="tiny", prompt="x", max_tokens=120, temperature=1.0, seed=3, n=2,
                                      extra_body={"guided_json": schema})
        for ch in r.choices:
            jsonschema.validate(json.loads(ch.text), schema)
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=120, temperature=1.0, seed=4,
                                           extra_body={"structured_outputs": {"json": schema}})
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_regex_choice_json_object_and_grammar(client):
    regex = r"[a-z]{2,5}-[0-9]{1,3}"
    r = client.completions.create(model="tiny", prompt="id:", max_tokens=30, temperature=1.0, seed=1, n=3,
                                  extra_body={"guided_regex": regex})
    assert all(re.fullmatch(regex, ch.text) for ch in r.choices), [c.text for c in r.choices]
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=0,
                                       extra_body={"structured_outputs": {"regex": regex}})
    assert re.fullmatch(regex, r.choices[0].message.content)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=10, temperature=1.0, seed=2, n=3,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert {c.message.content for c in r.choices} <= {"yes", "no", "maybe"}
    # json_object: any object (its keys are unbounded strings, so a random model may run to max_tokens;
    # then the text is a prefix of an object)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=60, temperature=0,
                                       response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    # a Lark grammar (llguidance's syntax) of small arithmetic sums: every output is Python that parses
    grammar = ('start: term | term OP term | term OP term OP term\n'
               'term: NUM | "(" NUM "*" NUM ")"\nOP: "+" | "-"\nNUM: /[1-9][0-9]{0,2}/\n')
    r = client.completions.create(model="tiny", prompt="1+1=", max_tokens=40, temperature=1.0, seed=5, n=4,
                                  extra_body={"guided_grammar": grammar})
    for ch in r.choices:
        assert ch.finish_reason == "stop", ch
        tree = ast.parse(ch.text, mode="eval")
        assert isinstance(eval(compile(tree, "<grammar>", "eval")), int), ch.text


REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format", "uniqueItems"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "string", "maxLenght": 3}}}},
     "guided_json", "maxLenght"),
    ({"structured_outputs": {"json": {"not": {"type": "string"}}}}, "structured_outputs", "not"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"guided_regex": "(unclosed"}, "guided_regex", None),
    ({"guided_grammar": "start: ("}, "guided_grammar", None),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", None),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", None),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos", None),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "tools"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS[:1] + [TOOLS[0]]}, "tools", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", "uniqueItems"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "propertiez": {}}}}], "tool_choice": "required"}, "tools", "propertiez"),
    ({"tools": TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls", None),
    ({"functions": [{"name": "f"}]}, "functions", None),
]


@pytest.mark.parametrize("body,param,named", REFUSED, ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(REFUSED)])
def test_refused_with_a_400_naming_the_field(served, body, param, named):
    path = "completions" if "guided_grammar" in body or "guided_decoding_backend" in body else "chat/completions"
    payload = {"model": "tiny", "max_tokens": 4, **body}
    payload.update({"prompt": "x"} if path == "completions" else {"messages": USER})
    r = httpx.post(f"{served.v1}/{path}", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    if named:
        assert named in err["message"], err


def test_required_and_named_tool_calls(client):
    # one call each (parallel_tool_calls false): a few dozen tokens
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=7, n=4)
    for ch in r.choices:
        assert ch.finish_reason == "tool_calls" and ch.message.content is None, ch
        assert len(ch.message.tool_calls) == 1
        check_calls(ch.message.tool_calls)
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named,
                                       max_tokens=150, temperature=1.0, seed=8, n=2)
    for ch in r.choices:
        assert len(ch.message.tool_calls) == 1 and ch.finish_reason == "tool_calls"
        check_calls(ch.message.tool_calls, ["get_weather"])
    # parallel calls (the default): the model chooses how many
    r = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                       max_tokens=600, temperature=1.0, seed=9)
    assert r.choices[0].finish_reason == "tool_calls", r
    check_calls(r.choices[0].message.tool_calls)


def test_streamed_tool_calls_match_the_schema(client):
    stream = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=150, temperature=1.0, seed=11, n=2,
                                            stream=True)
    joined = join_stream(stream)
    assert set(joined) == {0, 1}
    for choice in joined.values():
        assert choice["finish_reason"] == "tool_calls" and choice["content"] == ""
        assert choice["calls"]
        for call in choice["calls"].values():
            assert call["id"].startswith("call_") and call["name"] in SCHEMAS
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_auto_and_none(client):
    plain = client.chat.completions.create(model="tiny", messages=USER, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=8,
                                          temperature=0)
    auto = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, max_tokens=8, temperature=0)
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # `none` hides the tools
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens  # `auto` (the default) shows them
    assert auto.choices[0].finish_reason == "length" and not auto.choices[0].message.tool_calls
    # an earlier turn's calls and their results are rendered back (DeepSeek's format)
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="required",
                                       max_tokens=150, temperature=0)
    assert r.usage.prompt_tokens > auto.usage.prompt_tokens
    check_calls(r.choices[0].message.tool_calls)


def test_a_tokenizer_without_tool_tokens_refuses_tools(tiny_checkpoint):
    from deepinfer.entrypoints.openai.errors import OpenAIError
    from deepinfer.entrypoints.openai.protocol import ChatCompletionRequest
    from deepinfer.entrypoints.openai.tools import plan_tools
    from deepinfer.text.tokenizer import Tokenizer

    req = ChatCompletionRequest(messages=USER, tools=TOOLS)
    with pytest.raises(OpenAIError) as info:
        plan_tools(req, Tokenizer.from_pretrained(tiny_checkpoint))
    assert info.value.param == "tools" and "tool-call tokens" in info.value.message and "tools" in info.value.message


def test_the_servers_embedded_schema_keywords_are_the_cores():
    from deepinfer.entrypoints.openai.structured import JSON_SCHEMA_KEYWORDS
    from deepinfer.sample.grammar.schema_keywords import ANNOTATIONS, ENFORCED

    assert JSON_SCHEMA_KEYWORDS == ENFORCED["llguidance"] | ANNOTATIONS
