"""Shared pieces of the structured-output / tools / reasoning server tests: a tiny checkpoint given
DeepSeek's tool-call and think tokens (tools/stdlib_coder/add_special_tokens.py), and the tools."""

from __future__ import annotations

import json

import jsonschema

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": -9, "maximum": 9}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def tool_checkpoint(tiny_checkpoint: str, tmp_path_factory) -> str:
    from tools.stdlib_coder.add_special_tokens import add_special_tokens

    out = str(tmp_path_factory.mktemp("tool_ckpt") / "m")
    assert add_special_tokens(tiny_checkpoint, out)
    return out


def check_calls(calls, names=None) -> None:
    """Every call names a given function and its arguments validate against its parameters."""
    assert calls, "no tool call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in (names or SCHEMAS), call
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def join_stream(chunks) -> dict:
    """A streamed chat answer joined: {index: {"content", "reasoning", "calls": {i: {id, name, arguments}},
    "finish_reason"}}."""
    out: dict = {}
    for chunk in chunks:
        for ch in chunk.choices:
            o = out.setdefault(ch.index, {"content": "", "reasoning": "", "calls": {}, "finish_reason": None})
            d = ch.delta
            o["content"] += d.content or ""
            o["reasoning"] += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                call = o["calls"].setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                if tc.id:
                    assert call["id"] is None, "the id comes once"
                    call["id"], call["name"] = tc.id, tc.function.name
                call["arguments"] += tc.function.arguments or ""
            if ch.finish_reason:
                o["finish_reason"] = ch.finish_reason
    return out
