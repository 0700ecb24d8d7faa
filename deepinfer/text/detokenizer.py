"""Incremental detokenization: the text delta of each new token, never half a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character (a Chinese character is 3
bytes, most emoji 4, and a token may hold only some of them). Decoding such a prefix yields
U+FFFD, so while the decoded text ends with U+FFFD the delta is held back until a later token
completes the character (for at most _MAX_HELD tokens: longer runs are stray bytes). Decoding always covers a few tokens before the new ones (prefix_offset)
so tokenizers whose decoders depend on context (SentencePiece's leading-space rule) give the
same text as decoding the whole sequence.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.text.tokenizer import Tokenizer

# How many prompt tokens give the first generated tokens their decoding context.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"
# Text ending in U+FFFD is held back for at most this many tokens. A UTF-8 character is at most
# 4 bytes, so a longer run is stray bytes (random-weight models emit them for hundreds of
# tokens), not one unfinished character; holding it back forever would re-decode an ever longer
# window each step (O(output length)) and never emit the text at all. The last _KEEP_PENDING
# tokens stay held, so a character starting there can still complete, and the cut is where the
# text decoded so far is a prefix of the whole window's (no character split).
_MAX_HELD = 8
_KEEP_PENDING = 3


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        if skip_special_tokens:  # a skipped special token contributes no context
            special = tokenizer.special_token_ids
            context = [t for t in context if t not in special]
        self._ids: list[int] = context
        self._prefix_offset = 0  # _ids[prefix:read] were already emitted; decoded again for context
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode of _ids[prefix:read], kept while text is held back
        self._num_context = len(context)
        self._parts: list[str] = []  # the deltas; joined on read, so a step costs O(1), not O(text)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        return self._parts[0] if self._parts else ""

    @property
    def token_ids(self) -> list[int]:
        """The generated tokens added so far (after the prompt context in _ids)."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes ('' while held back)."""
        self._ids.append(token_id)
        prefix_text = self._prefix_text
        if prefix_text is None:
            prefix_text = self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text):
            return ""  # nothing new yet
        read = len(self._ids)
        if new_text.endswith(_REPLACEMENT):
            if read - self._read_offset <= _MAX_HELD:
                return ""  # an incomplete multi-byte character at the end
            # Stray bytes: emit them as decoded (U+FFFD, as decoding everything gives) up to a cut
            # that splits no character: its text must be a prefix of the whole window's text.
            for read in range(len(self._ids) - _KEEP_PENDING, self._read_offset, -1):
                cut_text = self._decode(self._ids[self._prefix_offset : read])
                if len(cut_text) > len(prefix_text) and new_text.startswith(cut_text):
                    new_text = cut_text
                    break
            else:
                return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = read
        self._prefix_text = None  # the window moved: decode the new prefix on the next add
        self._parts.append(delta)
        return delta
