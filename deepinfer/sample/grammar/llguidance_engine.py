"""The llguidance engine (the default): JSON Schema, regex, Lark-like grammars, choices.

Strict: schemas are compiled with lenient=false, so llguidance refuses the keywords it does not
implement ("Unimplemented keys: [...]") and unknown formats, and any validation warning is an
error too (fail closed); schema_keywords.py refuses the rest (unknown keywords) first. A compiled
grammar is a template LLMatcher; each sequence gets a deep copy (no re-compilation). The parser's
own resource limits (LLParserLimits: lexer fuel, grammar size) bound compile and mask work.
"""

from __future__ import annotations

import json
import re
from typing import Any

import torch

from deepinfer.errors import StructuredOutputError
from deepinfer.sample.grammar.backend import GrammarBackend, GrammarMatcher, TokenizerFacts
from deepinfer.sample.grammar.schema_keywords import check_schema_keywords

_UNIMPLEMENTED = re.compile(r'Unimplemented keys: \["([^"]+)"')
_MAX_GRAMMAR_SIZE = 500_000  # llguidance's symbols-in-productions limit (its default), stated explicitly


_EXECUTOR = None


def _executor():
    """llguidance's thread pool for batched mask fills, made on first use (one per process)."""
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._m = matcher

    def accept(self, token_id: int) -> bool:
        return bool(self._m.consume_token(int(token_id)))

    def fill_bitmask(self, row: torch.Tensor) -> None:
        self._m.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

    @classmethod
    def fill_bitmask_batch(cls, items: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call of llguidance's LLExecutor: the masks are computed on its thread pool, in
        Rust, without the GIL and without a Python call per row (measured on the CPU machine: the per-row
        loop was most of structured output's cost per step at batch 64)."""
        if not (bitmask.is_contiguous() and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"):
            raise ValueError("the grammar bitmask must be a contiguous int32 host tensor")
        _executor().unsafe_compute_mask_ptr([(m._m, j) for m, j in items], bitmask.data_ptr(),
                                            bitmask.shape[1] * bitmask.element_size(), bitmask.shape[0])

    def valid_prefix(self, tokens: list[int]) -> int:
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    @classmethod
    def fill_bitmask_draft_batch(cls, items: list[tuple[GrammarMatcher, int, list[int]]], bitmask: torch.Tensor
                                 ) -> None:
        """All rows of all drafts in one call of LLExecutor.unsafe_compute_mask_ptr_with_draft_token: llguidance
        advances each matcher through its draft, writes the mask of every state (row j + i after draft[:i]) and
        rolls the matcher back, in Rust on its thread pool. It refuses empty drafts: those rows take the plain
        batched fill."""
        plain = [(m, j) for m, j, d in items if not d]
        if plain:
            cls.fill_bitmask_batch(plain, bitmask)
        drafts = [(m._m, j, [int(t) for t in d]) for m, j, d in items if d]
        if drafts:
            _executor().unsafe_compute_mask_ptr_with_draft_token(drafts, bitmask.data_ptr(),
                                                                 bitmask.shape[1] * bitmask.element_size(),
                                                                 bitmask.shape[0])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self._m.rollback(num_tokens):
            raise StructuredOutputError("grammar", f"llguidance cannot roll back {num_tokens} tokens: "
                                        f"{self._m.get_error()}")

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())

    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class LLGuidanceBackend(GrammarBackend):
    name = "llguidance"

    def __init__(self, facts: TokenizerFacts):
        import llguidance

        super().__init__(facts)
        self._llg = llguidance
        self._tokenizer = llguidance.LLTokenizer(facts.tokenizer_json, n_vocab=facts.vocab_size,
                                                 eos_token=list(facts.eos_token_ids) or None)
        self._limits = llguidance.LLParserLimits(max_grammar_size=_MAX_GRAMMAR_SIZE, verbose_errors=False)

    def grammar_text(self, kind: str, spec: Any, whitespace: str) -> str:
        """The llguidance grammar (its JSON / Lark form) for a StructuredOutputsParams kind."""
        M = self._llg.LLMatcher
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else spec
            if kind == "json":
                check_schema_keywords(schema, self.name)
            options = {"lenient": False, "whitespace_flexible": whitespace == "flexible", "coerce_one_of": False}
            try:
                return M.grammar_from_json_schema(schema, overrides=options)
            except ValueError as exc:
                raise StructuredOutputError(kind, f"json is not a JSON Schema llguidance can read: {exc}") from None
        if kind == "regex":
            return M.grammar_from_regex(spec)
        if kind == "grammar":
            return M.grammar_from_lark(spec)
        if kind == "choice":  # Lark string literals are JSON strings
            return M.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec))
        raise StructuredOutputError(kind, f"unknown structured output kind {kind!r}")

    def compile(self, kind: str, spec: Any, whitespace: str) -> Any:
        grammar = self.grammar_text(kind, spec, whitespace)
        is_error, messages = self._llg.LLMatcher.validate_grammar_with_warnings(grammar, self._tokenizer,
                                                                                limits=self._limits)
        if is_error or messages:
            text = "; ".join(messages)[:500]
            m = _UNIMPLEMENTED.search(text)
            keyword = m.group(1) if m else None
            what = "JSON Schema" if kind in ("json", "json_object") else kind
            raise StructuredOutputError(kind, f"llguidance refuses this {what} ({'error' if is_error else 'warning'}, "
                                        f"not silently ignored): {text}", keyword=keyword)
        matcher = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise StructuredOutputError(kind, f"llguidance cannot build this {kind}: {matcher.get_error()[:500]}")
        return matcher

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return LLGuidanceMatcher(compiled.deep_copy())
