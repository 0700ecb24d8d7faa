"""R1-style reasoning (`--reasoning-parser deepseek_r1`): `<think>...</think>` goes to
`message.reasoning_content` (and streamed `reasoning_content` deltas), the rest to `content`;
a constraint applies only after the reasoning ends.

End to end, a Lark grammar that writes the reasoning section forces `<think>` on a random-weight
model; the wrappers the server builds for json / regex / tool calls after the reasoning are checked
against llguidance's matcher directly (a random model never ends its reasoning on its own).
"""

from __future__ import annotations

import json
import re

import openai
import pytest
from server_harness import make_engine, start_server
from structured_harness import TOOLS, tool_checkpoint

USER = [{"role": "user", "content": "Think, then answer."}]
GRAMMAR = "start: <think> /[a-z]{2,8}( [a-z]{2,8}){0,2}/ </think> /[0-9]{1,3}/\n"


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint, tmp_path_factory):
    return tool_checkpoint(tiny_checkpoint, tmp_path_factory)


@pytest.fixture(scope="module")
def client(ckpt):
    live = start_server(make_engine(ckpt), served_model_name="r1", reasoning_parser="deepseek_r1")
    yield openai.OpenAI(base_url=live.v1, api_key="x", max_retries=0)
    live.stop()


def test_reasoning_content_split_whole_and_streamed(client):
    body = {"structured_outputs": {"grammar": GRAMMAR}}
    r = client.chat.completions.create(model="r1", messages=USER, max_tokens=40, temperature=1.0, seed=3, n=3,
                                       extra_body=body)
    for ch in r.choices:
        assert ch.finish_reason == "stop"
        assert re.fullmatch(r"[a-z]{2,8}( [a-z]{2,8}){0,2}", ch.message.reasoning_content), ch.message
        assert re.fullmatch(r"[0-9]{1,3}", ch.message.content), ch.message
    stream = client.chat.completions.create(model="r1", messages=USER, max_tokens=40, temperature=1.0, seed=3, n=3,
                                            extra_body=body, stream=True)
    joined: dict = {}
    for chunk in stream:
        for ch in chunk.choices:
            o = joined.setdefault(ch.index, ["", ""])
            o[0] += ch.delta.reasoning_content or ""
            o[1] += ch.delta.content or ""
            assert "<think>" not in o[0] + o[1] and "</think>" not in o[0] + o[1]
    assert {i: tuple(v) for i, v in joined.items()} == {
        ch.index: (ch.message.reasoning_content, ch.message.content) for ch in r.choices}


def test_plain_output_is_all_reasoning_and_a_grammar_must_end_it(client):
    r = client.chat.completions.create(model="r1", messages=USER, max_tokens=6, temperature=0)
    msg = r.choices[0].message
    assert msg.content is None and msg.reasoning_content  # no </think> yet: everything is reasoning
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="r1", messages=USER, max_tokens=4,
                                       extra_body={"guided_grammar": 'start: "a"'})
    assert info.value.body["param"] == "guided_grammar" and "</think>" in info.value.body["message"]


def _matcher(ckpt, grammar: str):
    import llguidance

    with open(f"{ckpt}/tokenizer.json", encoding="utf-8") as f:
        text = f.read()
    from deepinfer.text.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(ckpt)
    lt = llguidance.LLTokenizer(text, n_vocab=tok.vocab_size, eos_token=tok.eos_token_id)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lt)
    assert not is_error and not messages, messages

    def accepts(s: str) -> bool:
        m = llguidance.LLMatcher(lt, grammar, log_level=0)
        return all(m.consume_token(t) for t in tok.encode(s, add_special_tokens=False)) and m.is_accepting()

    return accepts


def test_constraints_start_after_the_reasoning(ckpt):
    from deepinfer.entrypoints.openai.reasoning_parser import REASONING_PREFIX
    from deepinfer.entrypoints.openai.structured import StructuredRequest, after_prefix
    from deepinfer.entrypoints.openai.tool_parser import TOOL_CALLS_BEGIN, TOOL_CALLS_END, format_tool_call
    from deepinfer.entrypoints.openai.tools import tools_grammar
    from deepinfer.sampling_params import StructuredOutputsParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    wrapped = after_prefix(StructuredRequest("response_format", StructuredOutputsParams(json=schema)), REASONING_PREFIX)
    accepts = _matcher(ckpt, wrapped.params.grammar)
    assert accepts('<think>hmm, {"a": no</think>{"a": 1}') and accepts('free text</think>{"a":2}')
    assert not accepts('{"a": 1}') and not accepts('x</think>{"a": "1"}') and not accepts("x</think>y</think>{}")
    regex = after_prefix(StructuredRequest("guided_regex", StructuredOutputsParams(regex="a/b[0-9]")),
                         REASONING_PREFIX)
    accepts = _matcher(ckpt, regex.params.grammar)
    assert accepts("why</think>a/b7") and not accepts("a/b7") and not accepts("</think>a/bx")
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    grammar = tools_grammar(list(params.items()), True, REASONING_PREFIX)
    accepts = _matcher(ckpt, grammar)
    call = TOOL_CALLS_BEGIN + format_tool_call("add", json.dumps({"a": 5, "b": -2}, separators=(",", ":")))
    assert accepts("plan</think>" + call + TOOL_CALLS_END)
    assert not accepts(call + TOOL_CALLS_END)  # no reasoning section
    assert not accepts("plan</think>" + call.replace('"b":-2', '"b":-20') + TOOL_CALLS_END)  # b's maximum
