"""The engine-neutral grammar interface: what the sampler's grammar room asks of llguidance or XGrammar.

Why an interface: the two engines differ in syntax, speed and what they enforce (the issue's
anchors: llguidance accepted 0 invalid instances, older XGrammar 1,368), so the engine is a
setting (`EngineConfig.structured_output_backend`) and everything else (the cache, the
per-sequence state, the bitmask fill, the sampler) is written once against this interface.

The bitmask layout is the one both engines and the device op use: int32 [rows, ceil(V / 32)],
bit (t % 32) of word (t // 32) set = token t allowed; V is the MODEL's vocabulary (the logits'
width), which may exceed the tokenizer's (padding rows of the embedding): ids at or beyond the
tokenizer's size are never allowed, and neither is a special token other than EOS.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words per bitmask row for a vocabulary of vocab_size tokens."""
    return (vocab_size + 31) // 32


@dataclass(frozen=True)
class TokenizerFacts:
    """What both engines need to know about the engine's tokenizer, taken from it once.

    tokenizer_json: the Hugging Face `tokenizer.json` text (llguidance builds its token trie from it;
    XGrammar gets the pieces and the vocabulary type). vocab_size: the model's vocabulary (mask width).
    eos_token_ids: the ids that end generation; the grammar allows them only when it is complete.
    """

    tokenizer_json: str
    tokenizer_vocab_size: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def fingerprint(self) -> str:
        """Identifies the tokenizer in the compiled-grammar cache key."""
        h = hashlib.sha256(self.tokenizer_json.encode("utf-8"))
        h.update(repr((self.vocab_size, self.eos_token_ids)).encode())
        return h.hexdigest()[:16]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids) -> TokenizerFacts:
        """From deepinfer.text.tokenizer.Tokenizer (its `tokenizers` object: `_tok`; text/tokenizer.py
        has no public accessor for the serialized tokenizer)."""
        hf = tokenizer._tok
        eos = tuple(sorted({int(t) for t in eos_token_ids}))
        return cls(
            tokenizer_json=hf.to_str(),
            tokenizer_vocab_size=int(hf.get_vocab_size(with_added_tokens=True)),
            vocab_size=int(vocab_size),
            eos_token_ids=eos,
            special_token_ids=frozenset(int(t) for t in tokenizer.special_token_ids),
        )

    def pieces(self) -> list[str]:
        """The tokenizer's raw pieces by id (added tokens included; holes are "")."""
        data = json.loads(self.tokenizer_json)
        vocab = [""] * self.tokenizer_vocab_size
        for piece, i in data["model"]["vocab"].items():
            if 0 <= i < len(vocab):
                vocab[i] = piece
        for tok in data.get("added_tokens", []):
            if 0 <= tok["id"] < len(vocab):
                vocab[tok["id"]] = tok["content"]
        return vocab

    def decoder_kind(self) -> str:
        """"byte_level" | "byte_fallback" | "raw": how pieces map to bytes (tokenizer.json's decoder)."""
        data = json.loads(self.tokenizer_json)
        text = json.dumps(data.get("decoder"))
        if '"ByteLevel"' in text:
            return "byte_level"
        if '"ByteFallback"' in text:
            return "byte_fallback"
        return "raw"

    def forbidden_mask(self) -> torch.Tensor:
        """int32 [words]: bits set for ids no grammar may allow (beyond the tokenizer, specials but EOS)."""
        words = bitmask_words(self.vocab_size)
        allowed = torch.ones(words * 32, dtype=torch.bool)
        allowed[self.tokenizer_vocab_size:] = False
        for t in self.special_token_ids:
            if t not in self.eos_token_ids and 0 <= t < self.vocab_size:
                allowed[t] = False
        return ~pack_bits(allowed.view(1, -1))[0]


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [rows, 32k] -> int32 [rows, k] in the bitmask layout (bit i of word w = token 32w + i)."""
    rows, n = allowed.shape
    bits = allowed.view(rows, n // 32, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    packed = bits.sum(dim=-1)  # < 2**32: fits int64, then reinterpreted as int32
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_bits(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 [rows, k] -> bool [rows, vocab_size]: True = allowed."""
    shifts = torch.arange(32, dtype=torch.int32, device=mask.device)
    bits = (mask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(mask.shape[0], -1)[:, :vocab_size].bool()


class GrammarMatcher(ABC):
    """One sequence's parser state over one compiled grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False (and the matcher unusable) if the grammar forbids it."""

    @abstractmethod
    def fill_bitmask(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into row (int32 [words], contiguous, on the host)."""

    @classmethod
    def fill_bitmask_batch(cls, items: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """Fill row j of bitmask (int32 [rows, words], contiguous, on the host) for each (matcher, j), all
        matchers of this class. The default fills row by row; an engine with a parallel fill overrides it."""
        for matcher, j in items:
            matcher.fill_bitmask(bitmask[j])

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens (speculation, stop handling)."""

    @abstractmethod
    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of a draft the grammar allows from the current state, EOS included
        when the grammar is complete there; the state is left as it was (speculative decoding truncates
        a draft at its first forbidden token: sample/grammar/draft_mask.py)."""

    @classmethod
    def fill_bitmask_draft_batch(cls, items: list[tuple[GrammarMatcher, int, list[int]]], bitmask: torch.Tensor
                                 ) -> None:
        """For each (matcher, j, draft), all matchers of this class: rows j .. j + len(draft) of bitmask get the
        masks at the states after draft[:0], draft[:1], ..., draft (the matcher advanced tentatively through
        the draft); every matcher is back at its state afterwards. Every draft token must be allowed
        (valid_prefix) and none may be EOS (no mask exists after EOS). The default walks each matcher with
        fill / accept and rolls it back; engines with a batched, parallel walk override it."""
        for matcher, j, draft in items:
            n = matcher.valid_prefix(draft)
            if n < len(draft):  # checked before any state change: a caller's bug leaves the matcher intact
                raise ValueError(f"draft token {draft[n]} (slot {n}) is not allowed by the grammar: "
                                 "drafts must be cut at valid_prefix first")
            done = 0
            try:
                for t in draft:
                    matcher.fill_bitmask(bitmask[j + done])
                    if not matcher.accept(t):
                        raise ValueError(f"the grammar refused draft token {t} it allowed: {matcher.error()}")
                    done += 1
                matcher.fill_bitmask(bitmask[j + done])
            finally:
                matcher.rollback(done)

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and EOS was accepted: no further token is allowed."""

    @abstractmethod
    def error(self) -> str | None:
        """Why the matcher is unusable (a forbidden token, a resource limit), or None."""


class GrammarBackend(ABC):
    """One engine bound to one tokenizer: checks, compiles and makes matchers."""

    name: str

    def __init__(self, facts: TokenizerFacts):
        self.facts = facts

    @abstractmethod
    def compile(self, kind: str, spec: Any, whitespace: str) -> Any:
        """A compiled grammar (opaque, shareable between matchers) for a StructuredOutputsParams kind;
        raises StructuredOutputError for what this engine would not enforce or cannot parse."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""
