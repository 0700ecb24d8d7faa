"""Compile StructuredOutputsParams into shared compiled grammars: engine choice, cache, time and size bounds.

- Engine: GRAMMAR_BACKENDS names the engines; `check_backend_available` runs at engine start-up so
  asking for an engine that is not installed fails there, not at the first request.
- Cache: compiled grammars are kept in an LRU keyed by (engine, tokenizer fingerprint, kind, spec,
  whitespace), so the same schema sent again (the common case for tools and response formats)
  costs a dictionary lookup and a matcher copy. Failures are not cached.
- Bounds: a spec larger than max_bytes is refused before compiling; compiling runs on a worker
  thread and a compile that takes longer than timeout_s is a StructuredOutputError (the thread
  cannot be killed: it finishes in the background and its result is dropped; both engines also
  bound their own work: llguidance's lexer fuel and grammar size limits).
"""

from __future__ import annotations

import concurrent.futures
import importlib.util
import json
import time
from collections import OrderedDict
from typing import Any

from deepinfer.errors import ConfigError, StructuredOutputError
from deepinfer.sample.grammar.backend import GrammarBackend, GrammarMatcher, TokenizerFacts
from deepinfer.sampling_params import StructuredOutputsParams

# engine name -> (module with the GrammarBackend, class name, the pip package it needs)
GRAMMAR_BACKENDS: dict[str, tuple[str, str, str]] = {
    "llguidance": ("deepinfer.sample.grammar.llguidance_engine", "LLGuidanceBackend", "llguidance"),
    "xgrammar": ("deepinfer.sample.grammar.xgrammar_engine", "XGrammarBackend", "xgrammar"),
}
DEFAULT_CACHE_ENTRIES = 256


def check_backend_available(name: str) -> None:
    """ConfigError naming EngineConfig.structured_output_backend when the engine is unknown or not installed."""
    if name not in GRAMMAR_BACKENDS:
        raise ConfigError(f"EngineConfig.structured_output_backend must be one of {sorted(GRAMMAR_BACKENDS)} "
                          f"(got {name!r})")
    package = GRAMMAR_BACKENDS[name][2]
    if importlib.util.find_spec(package) is None:
        extra = ' (pip install "deepinfer[xgrammar]")' if name == "xgrammar" else ""
        raise ConfigError(f"EngineConfig.structured_output_backend={name!r} needs the {package!r} package, "
                          f"which is not installed{extra}")


def spec_of(so: StructuredOutputsParams) -> tuple[str, Any, str]:
    """(kind, the spec as the engines take it, its canonical text for the cache key and size limit)."""
    kind = so.kind
    if kind == "json":
        spec = so.schema()
        return kind, spec, json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
    if kind == "json_object":
        return kind, None, ""
    if kind == "choice":
        return kind, list(so.choice), json.dumps(so.choice, ensure_ascii=False)
    value = getattr(so, kind)
    return kind, value, value


class GrammarCompiler:
    """One per engine: the grammar engine bound to the engine's tokenizer, plus the cache."""

    def __init__(self, backend_name: str, facts: TokenizerFacts, timeout_s: float | None, max_bytes: int,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES):
        check_backend_available(backend_name)
        if facts.vocab_size < facts.tokenizer_vocab_size:
            raise ConfigError(f"structured output needs the model's vocabulary ({facts.vocab_size}) to cover the "
                              f"tokenizer's ({facts.tokenizer_vocab_size} ids)")
        module, cls, _ = GRAMMAR_BACKENDS[backend_name]
        self.backend: GrammarBackend = getattr(importlib.import_module(module), cls)(facts)
        self.facts = facts
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.cache_entries = cache_entries
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar")
        self.hits = 0
        self.misses = 0
        self.compile_seconds: list[float] = []  # per miss, for benchmarks and stats

    @property
    def name(self) -> str:
        return self.backend.name

    def compile(self, so: StructuredOutputsParams) -> Any:
        """The compiled grammar for `so` (cached); StructuredOutputError for what cannot be enforced."""
        kind, spec, text = spec_of(so)
        size = len(text.encode("utf-8"))
        if size > self.max_bytes:
            raise StructuredOutputError(kind, f"the {kind} is {size} bytes, over the limit of {self.max_bytes} "
                                        "(EngineConfig.structured_output_max_bytes)")
        key = (self.backend.name, self.facts.fingerprint, kind, text, so.whitespace)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            self.hits += 1
            return hit
        self.misses += 1
        start = time.perf_counter()
        future = self._pool.submit(self.backend.compile, kind, spec, so.whitespace)
        try:
            compiled = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            # the stuck compile keeps its thread until it ends; later compiles get a fresh one
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-grammar")
            raise StructuredOutputError(kind, f"compiling the {kind} took longer than {self.timeout_s:g} s "
                                        "(EngineConfig.structured_output_compile_timeout_s); simplify it") from None
        self.compile_seconds.append(time.perf_counter() - start)
        self._cache[key] = compiled
        if len(self._cache) > self.cache_entries:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, compiled: Any) -> GrammarMatcher:
        return self.backend.matcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
