"""DeepSeek tool calls: the special tokens, and a parser turning model output into OpenAI tool calls.

DeepSeek-V3 / R1 chat templates write a call as

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    (more calls, each optionally after a "\\n") <｜tool▁calls▁end｜>

and DeepSeek-V3.1's template drops the type and the fence: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>`.
Both are parsed. Why one incremental parser for streamed and whole outputs: the two answers of a
request must agree; a whole output is parsed by feeding it in one piece.

Text before the calls section is message content; text after `<｜tool▁calls▁end｜>` too (the model
rarely writes any). Arguments are passed on as the model wrote them (with `tool_choice` `required`
or a named function the grammar made them valid JSON for the function's schema; with `auto` they
are what the model emitted, as OpenAI's own API documents).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

TOOL_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
TOOL_CALLS_END = "<｜tool▁calls▁end｜>"
TOOL_CALL_BEGIN = "<｜tool▁call▁begin｜>"
TOOL_CALL_END = "<｜tool▁call▁end｜>"
TOOL_SEP = "<｜tool▁sep｜>"
TOOL_OUTPUTS_BEGIN = "<｜tool▁outputs▁begin｜>"
TOOL_OUTPUTS_END = "<｜tool▁outputs▁end｜>"
TOOL_OUTPUT_BEGIN = "<｜tool▁output▁begin｜>"
TOOL_OUTPUT_END = "<｜tool▁output▁end｜>"
# every token DeepSeek's tool-calling templates write, in the order DeepSeek-V3's tokenizer numbers them
TOOL_TOKENS = [TOOL_CALLS_BEGIN, TOOL_CALLS_END, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_SEP,
               TOOL_OUTPUTS_BEGIN, TOOL_OUTPUTS_END, TOOL_OUTPUT_BEGIN, TOOL_OUTPUT_END]

_FENCE_OPEN = "\n```json\n"
_FENCE_CLOSE = "\n```"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _held_suffix(text: str, *markers: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `markers` (text that
    may still become a marker, so it is held back from the client)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(text)), best, -1):
            if marker.startswith(text[-k:]):
                best = k
                break
    return best


@dataclass
class ToolCallDelta:
    """A piece of one call: its first delta has id and name, later ones only argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedToolCall:
    id: str
    name: str
    arguments: str


@dataclass
class ToolCallParser:
    """Feed output text deltas; get (content delta, tool-call deltas) back. `finish` flushes what was
    held back. States: content -> calls (between calls) -> header (type / name) -> arguments."""

    state: str = "content"
    buf: str = ""
    calls: list[ParsedToolCall] = field(default_factory=list)
    _fenced: bool = False  # the current call is V3's ```json fenced form

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self.buf += text
        content, deltas = [], []
        while True:
            progressed = self._step(content, deltas, final=False)
            if not progressed:
                break
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        content, deltas = [], []
        while self._step(content, deltas, final=True):
            pass
        return "".join(content), deltas

    # one transition; True when it consumed something (so the loop tries again)
    def _step(self, content: list[str], deltas: list[ToolCallDelta], final: bool) -> bool:
        buf = self.buf
        if not buf:
            return False
        if self.state in ("content", "after"):
            if self.state == "content":
                i = buf.find(TOOL_CALLS_BEGIN)
                if i >= 0:
                    content.append(buf[:i])
                    self.buf, self.state = buf[i + len(TOOL_CALLS_BEGIN):], "calls"
                    return True
            keep = 0 if final or self.state == "after" else _held_suffix(buf, TOOL_CALLS_BEGIN)
            content.append(buf[: len(buf) - keep])
            self.buf = buf[len(buf) - keep:]
            return False
        if self.state == "calls":
            stripped = buf.lstrip()
            if stripped.startswith(TOOL_CALLS_END):
                self.buf, self.state = stripped[len(TOOL_CALLS_END):], "after"
                return True
            if stripped.startswith(TOOL_CALL_BEGIN):
                self.buf, self.state = stripped[len(TOOL_CALL_BEGIN):], "header"
                return True
            if final or (stripped and not TOOL_CALLS_END.startswith(stripped) and not TOOL_CALL_BEGIN.startswith(stripped)):
                # not the format: what is left is text the model wrote, kept as content
                self.buf, self.state = buf, "after"
                return True
            return False
        if self.state == "header":
            sep = buf.find(TOOL_SEP)
            if sep < 0:
                if final:
                    self.buf, self.state = "", "after"
                return False
            head, rest = buf[:sep], buf[sep + len(TOOL_SEP):]
            if head == "function" and not rest.lstrip().startswith("{"):  # V3: the name follows on its own line
                nl = rest.find("\n")
                if nl < 0:
                    if final:
                        self._open(rest.strip(), deltas, fenced=True)
                        self.buf, self.state = "", "args"
                    return False
                name, rest = rest[:nl], rest[nl:]
                fenced = True
            else:  # V3.1: NAME<｜tool▁sep｜>ARGS
                name, fenced = head, False
            if fenced:
                if len(rest) < len(_FENCE_OPEN) and _FENCE_OPEN.startswith(rest) and not final:
                    return False
                if rest.startswith(_FENCE_OPEN):
                    rest = rest[len(_FENCE_OPEN):]
                else:
                    rest = rest.lstrip("\n")
            self._open(name.strip(), deltas, fenced)
            self.buf, self.state = rest, "args"
            return True
        if self.state == "args":
            end = buf.find(TOOL_CALL_END)
            if end >= 0:
                args = buf[:end]
                if self._fenced and args.endswith(_FENCE_CLOSE):
                    args = args[: -len(_FENCE_CLOSE)]
                self._args(args, deltas)
                self.buf, self.state = buf[end + len(TOOL_CALL_END):], "calls"
                return True
            if final:  # cut off (max_tokens): the arguments written so far
                self._args(buf, deltas)
                self.buf = ""
                return False
            keep = _held_suffix(buf, TOOL_CALL_END, _FENCE_CLOSE + TOOL_CALL_END) if self._fenced else \
                _held_suffix(buf, TOOL_CALL_END)
            if self._fenced and buf.endswith(_FENCE_CLOSE):
                keep = max(keep, len(_FENCE_CLOSE))
            self._args(buf[: len(buf) - keep], deltas)
            self.buf = buf[len(buf) - keep:]
            return False
        raise AssertionError(self.state)

    def _open(self, name: str, deltas: list[ToolCallDelta], fenced: bool) -> None:
        call = ParsedToolCall(id=new_call_id(), name=name, arguments="")
        self.calls.append(call)
        self._fenced = fenced
        deltas.append(ToolCallDelta(index=len(self.calls) - 1, id=call.id, name=name))

    def _args(self, text: str, deltas: list[ToolCallDelta]) -> None:
        if not text:
            return
        self.calls[-1].arguments += text
        if deltas and deltas[-1].index == len(self.calls) - 1:
            deltas[-1].arguments += text
        else:
            deltas.append(ToolCallDelta(index=len(self.calls) - 1, arguments=text))


def parse_tool_calls(text: str) -> tuple[str, list[ParsedToolCall]]:
    """(content, calls) of a whole output; content is the text outside the calls section."""
    parser = ToolCallParser()
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    return content + rest, parser.calls


def format_tool_call(name: str, arguments: str) -> str:
    """One call as DeepSeek-V3's template writes it (what a grammar for required calls produces)."""
    return f"{TOOL_CALL_BEGIN}function{TOOL_SEP}{name}{_FENCE_OPEN}{arguments}{_FENCE_CLOSE}{TOOL_CALL_END}"
