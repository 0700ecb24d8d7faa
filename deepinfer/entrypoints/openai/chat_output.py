"""A chat choice's text -> its OpenAI message: reasoning split off (--reasoning-parser), tool calls
parsed (tools with tool_choice other than `none`), for the whole output and for streamed deltas.

One ChoiceParser per choice runs both parsers incrementally; the non-streamed answer feeds it the
whole text at once, so both answers of a request agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deepinfer.entrypoints.openai.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from deepinfer.entrypoints.openai.reasoning_parser import ReasoningParser
from deepinfer.entrypoints.openai.tool_parser import ToolCallDelta, ToolCallParser


@dataclass
class ChoiceParser:
    reasoning: ReasoningParser | None
    tools: ToolCallParser | None
    saw_calls: bool = False
    _reasoning_text: list[str] = field(default_factory=list)
    _content_text: list[str] = field(default_factory=list)

    @classmethod
    def make(cls, reasoning: bool, tools: bool) -> ChoiceParser | None:
        if not reasoning and not tools:
            return None
        return cls(ReasoningParser() if reasoning else None, ToolCallParser() if tools else None)

    def feed(self, text: str, final: bool = False) -> tuple[str, str, list[ToolCallDelta]]:
        """(reasoning delta, content delta, tool-call deltas) of the next piece of output text."""
        reasoning, content = "", text
        if self.reasoning is not None:
            if final:
                r1, c1 = self.reasoning.feed(text)
                r2, c2 = self.reasoning.finish()
                reasoning, content = r1 + r2, c1 + c2
            else:
                reasoning, content = self.reasoning.feed(text)
        deltas: list[ToolCallDelta] = []
        if self.tools is not None:
            content, deltas = self.tools.feed(content)
            if final:
                rest, more = self.tools.finish()
                content += rest
                deltas += more
            self.saw_calls = self.saw_calls or bool(self.tools.calls)
        self._reasoning_text.append(reasoning)
        self._content_text.append(content)
        return reasoning, content, deltas

    def message(self) -> ChatResponseMessage:
        """The whole message (after the last feed, with final=True)."""
        reasoning = "".join(self._reasoning_text)
        content = "".join(self._content_text)
        calls = []
        if self.tools is not None:
            calls = [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                     for c in self.tools.calls]
        if calls and not content.strip():
            content = ""
        return ChatResponseMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI's "tool_calls" when the model ended after calling tools (not when it was cut off)."""
        if engine_reason == "stop" and self.saw_calls:
            return "tool_calls"
        return engine_reason


def whole_message(parser: ChoiceParser | None, text: str, engine_reason: str | None):
    """(message, finish_reason) of a finished choice."""
    if parser is None:
        return ChatResponseMessage(content=text), engine_reason
    parser.feed(text, final=True)
    return parser.message(), parser.finish_reason(engine_reason)


def delta_message(parser: ChoiceParser | None, text: str, finished: bool) -> DeltaMessage | None:
    """The DeltaMessage of the next text piece (None: nothing to show yet)."""
    if parser is None:
        return DeltaMessage(content=text) if text or not finished else None
    reasoning, content, deltas = parser.feed(text, final=finished)
    calls = [DeltaToolCall(index=d.index, id=d.id, type="function" if d.id else None,
                           function=DeltaFunctionCall(name=d.name, arguments=d.arguments))
             for d in deltas]
    if not reasoning and not content and not calls:
        return None
    return DeltaMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls or None)
