"""The XGrammar engine (optional: `pip install "deepinfer[xgrammar]"`): JSON Schema, regex, EBNF, choices.

XGrammar compiles schemas holding keywords it does not implement and ignores them (uniqueItems,
not, contains, format, unknown keywords: checked with 0.2.9), so schemas go through
schema_keywords.py with XGrammar's own, shorter list first. strict_mode is off: a schema means
what JSON Schema says (additional properties allowed unless the schema forbids them), so every
valid instance stays reachable (the mask oracle checks it). Grammars are XGrammar's EBNF
(GBNF style: `root ::= ...`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from deepinfer.errors import StructuredOutputError
from deepinfer.sample.grammar.backend import GrammarBackend, GrammarMatcher, TokenizerFacts
from deepinfer.sample.grammar.schema_keywords import check_schema_keywords


def _xgrammar():
    import xgrammar

    return xgrammar


_BATCH = None


def _batch_matcher():
    """XGrammar's batched fill (its own thread pool), made on first use (one per process)."""
    global _BATCH
    if _BATCH is None:
        _BATCH = _xgrammar().BatchGrammarMatcher()
    return _BATCH


class XGrammarMatcher(GrammarMatcher):
    def __init__(self, matcher: Any):
        self._m = matcher
        self._error: str | None = None

    def accept(self, token_id: int) -> bool:
        ok = bool(self._m.accept_token(int(token_id)))
        if not ok:
            self._error = f"token {token_id} is not allowed by the grammar"
        return ok

    def fill_bitmask(self, row: torch.Tensor) -> None:
        self._m.fill_next_token_bitmask(row.view(1, -1), 0)

    @classmethod
    def fill_bitmask_batch(cls, items: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """All rows in one call of XGrammar's BatchGrammarMatcher.batch_fill_next_token_bitmask (its C++ thread
        pool), like llguidance's LLExecutor fill: no Python call per row (the per-row loop was the cost of a
        step's host fill at batch 64: docs/structured-output.md)."""
        if not (bitmask.is_contiguous() and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"):
            raise ValueError("the grammar bitmask must be a contiguous int32 host tensor")
        if items:
            _batch_matcher().batch_fill_next_token_bitmask([m._m for m, _ in items], bitmask,
                                                           indices=[int(j) for _, j in items])

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._m.rollback(num_tokens)

    def valid_prefix(self, tokens: list[int]) -> int:
        """XGrammar has no validate call: accept tentatively (a refused token leaves the state as it was, checked
        with 0.2.9), then roll back what was accepted."""
        n = 0
        try:
            for t in tokens:
                if self._m.is_terminated() or not self._m.accept_token(int(t)):
                    break
                n += 1
        finally:
            if n:
                self._m.rollback(n)
        return n

    @classmethod
    def fill_bitmask_draft_batch(cls, items: list[tuple[GrammarMatcher, int, list[int]]], bitmask: torch.Tensor
                                 ) -> None:
        """Depth by depth with XGrammar's BatchGrammarMatcher: fill the rows of every matcher at draft depth d,
        accept draft token d in all that go deeper, then roll every matcher back by its draft's length."""
        xgr = _xgrammar()
        live = [(m._m, j, list(d)) for m, j, d in items]
        advanced = [0] * len(live)
        batch = _batch_matcher()
        try:
            depth = 0
            while live_at := [i for i, (_, _, d) in enumerate(live) if len(d) >= depth]:
                batch.batch_fill_next_token_bitmask([live[i][0] for i in live_at], bitmask,
                                                    indices=[live[i][1] + depth for i in live_at])
                deeper = [i for i in live_at if len(live[i][2]) > depth]
                if deeper:
                    ok = xgr.BatchGrammarMatcher.batch_accept_token([live[i][0] for i in deeper],
                                                                    [int(live[i][2][depth]) for i in deeper])
                    for i, good in zip(deeper, ok):
                        advanced[i] += bool(good)
                    bad = [i for i, good in zip(deeper, ok) if not good]
                    if bad:
                        raise ValueError(f"draft token {live[bad[0]][2][depth]} (slot {depth}) is not allowed by the "
                                         "grammar: drafts must be cut at valid_prefix first")
                depth += 1
        finally:
            back = [(m, n) for (m, _, _), n in zip(live, advanced) if n]
            if back:
                xgr.BatchGrammarMatcher.batch_rollback([m for m, _ in back], [n for _, n in back])

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())

    def error(self) -> str | None:
        return self._error


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, facts: TokenizerFacts):
        import xgrammar

        super().__init__(facts)
        self._xgr = xgrammar
        kinds = {"byte_level": xgrammar.VocabType.BYTE_LEVEL, "byte_fallback": xgrammar.VocabType.BYTE_FALLBACK,
                 "raw": xgrammar.VocabType.RAW}
        info = xgrammar.TokenizerInfo(facts.pieces(), kinds[facts.decoder_kind()], vocab_size=facts.vocab_size,
                                      stop_token_ids=list(facts.eos_token_ids), add_prefix_space=False)
        # our cache (compiler.py) keys compiled grammars; one thread: the engine compiles one at a time
        self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, kind: str, spec: Any, whitespace: str) -> Any:
        c = self._compiler
        try:
            if kind in ("json", "json_object"):
                schema = {"type": "object"} if kind == "json_object" else spec
                if kind == "json":
                    check_schema_keywords(schema, self.name)
                compact = whitespace == "compact"
                return c.compile_json_schema(json.dumps(schema), any_whitespace=not compact,
                                             separators=(",", ":") if compact else None, strict_mode=False)
            if kind == "regex":
                return c.compile_regex(spec)
            if kind == "grammar":
                return c.compile_grammar(spec)
            if kind == "choice":  # EBNF string literals take JSON-style escapes
                return c.compile_grammar("root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in spec))
        except StructuredOutputError:
            raise
        except (RuntimeError, ValueError) as exc:
            text = " ".join(str(exc).split())[:500]
            raise StructuredOutputError(kind, f"xgrammar cannot compile this {kind}: {text}") from None
        raise StructuredOutputError(kind, f"unknown structured output kind {kind!r}")

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return XGrammarMatcher(self._xgr.GrammarMatcher(compiled, override_stop_tokens=list(self.facts.eos_token_ids)
                                                        or None))
