"""R1-style reasoning: the text up to `</think>` is `reasoning_content`, the rest `content`.

DeepSeek-R1's template ends the prompt with `<think>\\n`, so the output usually starts inside the
reasoning and the model may never write `<think>` itself; an output that does start with `<think>`
has it dropped. An output without `</think>` is all reasoning (it was cut off, or the model never
left its reasoning), as vLLM's `deepseek_r1` parser does. One incremental parser serves streamed
and whole outputs, so both answers agree.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"
THINK_TOKENS = [THINK_START, THINK_END]
REASONING_PARSERS = ("deepseek_r1",)
# The reasoning section as a Lark expression (llguidance's syntax): an optional <think> token, any
# text, then the </think> token. A constraint (structured.after_prefix, tools.tools_grammar) follows
# it, so it applies only once the reasoning ended. Special tokens are named as tokens: the text
# of the reasoning cannot hold one (llguidance's `.` never matches a special token).
REASONING_PREFIX = f"({THINK_START})? /(?s:.*)/ {THINK_END}"


def _held_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


@dataclass
class ReasoningParser:
    """Feed output text deltas; get (reasoning delta, content delta) back; `finish` flushes."""

    state: str = "start"  # start (a leading <think> may come) -> reasoning -> content
    buf: str = ""

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        self.buf += text
        reasoning, content = "", ""
        if self.state == "start":
            stripped = self.buf.lstrip()
            if stripped.startswith(THINK_START):
                self.buf, self.state = stripped[len(THINK_START):], "reasoning"
            elif THINK_START.startswith(stripped) and not final:
                return "", ""  # it may still become <think>
            else:
                self.state = "reasoning"
        if self.state == "reasoning":
            i = self.buf.find(THINK_END)
            if i >= 0:
                reasoning = self.buf[:i]
                self.buf, self.state = self.buf[i + len(THINK_END):], "content"
            else:
                keep = 0 if final else _held_suffix(self.buf, THINK_END)
                reasoning = self.buf[: len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return reasoning, ""
        content, self.buf = self.buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        return self.feed("", final=True)

    @property
    def in_content(self) -> bool:
        return self.state == "content"


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output; None for a part that is empty."""
    parser = ReasoningParser()
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    reasoning, content = r1 + r2, c1 + c2
    return reasoning or None, content or None
