"""OpenAI `tools` + `tool_choice` on /v1/chat/completions, for DeepSeek's tool-call format.

- `none`: the tools are not shown to the model (not rendered) and nothing is parsed.
- `auto` (the default with tools): the tools are rendered by the chat template, the model is
  free, and what it writes in the tool-call format is parsed into `message.tool_calls`.
- `required` / a named function: the output is constrained by a grammar (llguidance's Lark
  syntax, the SamplingParams `grammar` kind) that admits only a calls section whose every call
  names an allowed function and whose arguments are JSON valid for that function's `parameters`
  schema (`%json` in the grammar); so the output always parses and validates. The schema keywords
  are checked by the engine as for `response_format` (fail closed: a keyword it would not
  enforce is a 400 naming it). `parallel_tool_calls: false` allows exactly one call.

The tool-call tokens must be in the model's tokenizer (tools/stdlib_coder/add_special_tokens.py
adds them to a checkpoint); a model without them answers tools requests with a 400.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from deepinfer.entrypoints.openai.errors import bad_request
from deepinfer.entrypoints.openai.structured import check_known_keywords
from deepinfer.entrypoints.openai.tool_parser import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_SEP,
    TOOL_TOKENS,
)

_ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request uses its tools: what the template sees, what is parsed, what is enforced."""

    choice: str  # "none" | "auto" | "required" | "named"
    tools: list[dict]  # rendered by the chat template (empty for none)
    grammar: str | None = None  # the Lark grammar enforcing required / named calls

    @property
    def parse(self) -> bool:
        return self.choice != "none"


def _lark_str(text: str) -> str:
    """A Lark string literal (JSON's escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def tools_grammar(functions: list[tuple[str, dict]], parallel: bool, prefix: str = "") -> str:
    """The Lark grammar (llguidance's syntax) of a calls section calling only `functions` ((name,
    parameters schema) pairs) in DeepSeek-V3's format: one call, or any number >= 1 when `parallel`.
    The format's tokens are written as special tokens (`<｜tool▁sep｜>`: that token, not its
    spelling in bytes); `prefix` is a Lark expression allowed first (reasoning_parser.REASONING_PREFIX)."""
    start = f"{prefix} " if prefix else ""
    more = ' ("\\n" call)*' if parallel else ""
    names = [f"fn_{i}" for i in range(len(functions))]
    lines = [f"start: {start}{TOOL_CALLS_BEGIN} call{more} {TOOL_CALLS_END}",
             f"call: {TOOL_CALL_BEGIN} \"function\" {TOOL_SEP} ({' | '.join(names)})"]
    for rule, (name, schema) in zip(names, functions):
        lines.append(f"{rule}: {_lark_str(name + chr(10) + '```json' + chr(10))} {rule}_args "
                     f"{_lark_str(chr(10) + '```')} {TOOL_CALL_END}")
        # no free whitespace: `{"a": 1, "b": 2}` (one space after ":" and ","), as DeepSeek writes arguments;
        # free whitespace would let a weak model pad the arguments until max_tokens
        fixed = {**schema, "x-guidance": {"whitespace_flexible": False}}
        lines.append(f"{rule}_args: %json {json.dumps(fixed, ensure_ascii=False)}")
    return "\n".join(lines) + "\n"


def has_tool_tokens(tokenizer) -> bool:
    to_id = getattr(tokenizer, "token_to_id", None)
    return to_id is not None and all(to_id(t) is not None for t in TOOL_TOKENS)


def plan_tools(req, tokenizer, prefix: str = "") -> ToolPlan | None:
    """The request's ToolPlan (None: no tools, no tool_choice); 400 naming the field for a bad combination."""
    tools = req.tools or []
    choice = req.tool_choice
    if (tools or choice is not None) and not has_tool_tokens(tokenizer):
        raise bad_request(f"{'tools are' if tools else 'tool_choice is'} not supported by this model: its tokenizer "
                          "lacks DeepSeek's tool-call tokens (tools/stdlib_coder/add_special_tokens.py adds them to a "
                          "checkpoint)", "tools" if tools else "tool_choice", "unsupported_parameter")
    if not tools:
        if choice is None or choice == "none":
            return None
        raise bad_request("tool_choice needs tools", "tool_choice")
    names = [t.function.name for t in tools]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad_request(f"tools: the function name {dup!r} is given twice", "tools")
    if choice is None:
        choice = "auto"
    if choice == "none":
        return ToolPlan("none", [])
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    for tool in rendered:  # templates read parameters; OpenAI's default is an object with any properties
        tool["function"].setdefault("parameters", dict(_ANY_OBJECT))
    if choice == "auto":
        if req.parallel_tool_calls is False:
            raise bad_request("parallel_tool_calls false is enforced only with tool_choice 'required' or a named "
                              "function (with 'auto' the model is free)", "parallel_tool_calls",
                              "unsupported_parameter")
        return ToolPlan("auto", rendered)
    by_name = {t["function"]["name"]: t["function"] for t in rendered}
    if choice == "required":
        allowed = list(by_name)
        kind = "required"
    else:
        wanted = choice.function.name
        if wanted not in by_name:
            raise bad_request(f"tool_choice names the function {wanted!r}, which is not in tools", "tool_choice")
        allowed, kind = [wanted], "named"
    parallel = req.parallel_tool_calls is not False and kind == "required"
    functions = [(n, by_name[n]["parameters"]) for n in allowed]
    for i, (n, schema) in enumerate(functions):
        check_known_keywords(schema, "tools", f"#/{n}/parameters")
    return ToolPlan(kind, rendered, tools_grammar(functions, parallel, prefix))
