"""The DeepSeek tool-call parser and the R1 reasoning parser: whole outputs, and the same outputs
streamed in pieces of every size (the streamed deltas must add up to the whole parse)."""

from __future__ import annotations

import json

import pytest

from deepinfer.entrypoints.openai.reasoning_parser import ReasoningParser, split_reasoning
from deepinfer.entrypoints.openai.tool_parser import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    ToolCallParser,
    format_tool_call,
    parse_tool_calls,
)

V3_TWO = (
    "Let me check." + TOOL_CALLS_BEGIN + format_tool_call("get_weather", '{"city": "Paris"}') + "\n"
    + format_tool_call("add", '{"a": 1, "b": [2, 3]}') + TOOL_CALLS_END
)
V31 = TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "lookup" + TOOL_SEP + '{"q": "x```y"}' + TOOL_CALL_END + TOOL_CALLS_END


def test_whole_outputs():
    content, calls = parse_tool_calls(V3_TWO)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": [2, 3]})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    content, calls = parse_tool_calls(V31)
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("lookup", '{"q": "x```y"}')]
    content, calls = parse_tool_calls("no calls at all <｜tool▁ nope")
    assert content == "no calls at all <｜tool▁ nope" and calls == []


def test_not_the_format_stays_content():
    text = TOOL_CALLS_BEGIN + "garbage"
    content, calls = parse_tool_calls(text)
    assert calls == [] and content == "garbage"


def test_cut_off_arguments_are_kept():
    content, calls = parse_tool_calls(TOOL_CALLS_BEGIN + TOOL_CALL_BEGIN + "function" + TOOL_SEP + "f\n```json\n{\"a\": ")
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"a": ')]


@pytest.mark.parametrize("text", [V3_TWO, V31, "plain text only", "a<｜tool", V3_TWO + " trailing"])
@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_streamed_pieces_add_up_to_the_whole_parse(text, size):
    whole_content, whole_calls = parse_tool_calls(text)
    parser = ToolCallParser()
    content, names, args, ids = "", {}, {}, {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for out in [parser.feed(p) for p in pieces] + [parser.finish()]:
        text_delta, deltas = out
        content += text_delta
        for d in deltas:
            if d.name is not None:
                assert d.index not in names  # the name comes once, in the call's first delta
                names[d.index], ids[d.index] = d.name, d.id
            args[d.index] = args.get(d.index, "") + d.arguments
    assert content == whole_content
    assert [names[i] for i in sorted(names)] == [c.name for c in whole_calls]
    assert [args.get(i, "") for i in sorted(names)] == [c.arguments for c in whole_calls]
    for marker in ("```", "<｜tool"):  # no marker leaks into the streamed arguments
        assert all(marker not in a for a in args.values() if '"x```y"' not in a)


def test_reasoning_split():
    assert split_reasoning("<think>\nhmm, 2+2</think>\n\n4") == ("\nhmm, 2+2", "\n\n4")
    assert split_reasoning("hmm</think>4") == ("hmm", "4")  # the prompt opened <think>
    assert split_reasoning("never ends") == ("never ends", None)
    assert split_reasoning("</think>") == (None, None)


@pytest.mark.parametrize("text", ["<think>abc</think>def", "abc</th", "ab</think>", "<thi", "x</think></think>y"])
@pytest.mark.parametrize("size", [1, 2, 5])
def test_reasoning_streamed_pieces_add_up(text, size):
    parser = ReasoningParser()
    r, c = "", ""
    for i in range(0, len(text), size):
        dr, dc = parser.feed(text[i:i + size])
        r, c = r + dr, c + dc
    dr, dc = parser.finish()
    whole = split_reasoning(text)
    assert ((r + dr) or None, (c + dc) or None) == whole
