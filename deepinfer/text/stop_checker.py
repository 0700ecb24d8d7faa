"""Stop strings over streamed text, with hold-back so a stop string is never emitted.

A stop string can arrive split across deltas ("<|e" then "nd|>"). Text is emitted only once it
cannot be the start of a stop string: the longest tail of the pending text that is a proper
prefix of some stop string is held back until later text rules it in or out. When a stop
string matches, the text before its earliest occurrence is emitted (plus the stop string itself
with include_stop_str_in_output) and the checker is done.
"""

from __future__ import annotations

from deepinfer.errors import InvalidRequestError


class StopChecker:
    def __init__(self, stop: list[str], include_stop_str_in_output: bool = False):
        if not all(isinstance(s, str) and s for s in stop):
            raise InvalidRequestError(f"stop strings must be non-empty strings (got {stop!r})", param="stop")
        self.stop = list(stop)
        self.include_stop_str_in_output = include_stop_str_in_output
        self._max_hold = max((len(s) for s in self.stop), default=1) - 1
        self._pending = ""
        self.matched: str | None = None

    @property
    def done(self) -> bool:
        return self.matched is not None

    def _find(self, text: str) -> tuple[int, str] | None:
        """Earliest occurrence of any stop string (the longest one when several start there)."""
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = text.find(s)
            if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(s) > len(best[1]))):
                best = (i, s)
        return best

    def _held_len(self, text: str) -> int:
        """Length of the longest tail of text that is a proper prefix of some stop string."""
        for n in range(min(self._max_hold, len(text)), 0, -1):
            tail = text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Add new text; return (text safe to emit now, the stop string matched or None).

        After a match every later call returns ("", None): the request is finished.
        """
        if self.done:
            return "", None
        text = self._pending + delta
        hit = self._find(text)
        if hit is not None:
            i, s = hit
            self._pending = ""
            self.matched = s
            return text[:i] + (s if self.include_stop_str_in_output else ""), s
        held = self._held_len(text)
        self._pending = text[len(text) - held :] if held else ""
        return text[: len(text) - held], None

    def flush(self) -> str:
        """At the end of generation (no stop string matched): the held-back text."""
        text, self._pending = self._pending, ""
        return text
