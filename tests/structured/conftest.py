"""Shared fixtures of tests/structured: the embedded model's tokenizer facts and one compiler per engine."""

from __future__ import annotations

import pytest

from deepinfer.sample.grammar.backend import TokenizerFacts
from deepinfer.sample.grammar.compiler import GrammarCompiler


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from deepinfer import embedded_model_path
    from deepinfer.text.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(embedded_model_path())


@pytest.fixture(scope="session")
def facts(embedded_tokenizer):
    """The embedded model's tokenizer (4096 ids), with the model vocabulary padded to 4160: ids
    4096..4159 exist in the logits but not in the tokenizer (the padding case)."""
    return TokenizerFacts.from_tokenizer(embedded_tokenizer, 4160, [embedded_tokenizer.eos_token_id])


@pytest.fixture(scope="session")
def compilers(facts):
    made: dict[str, GrammarCompiler] = {}

    def get(engine: str) -> GrammarCompiler:
        if engine not in made:
            made[engine] = GrammarCompiler(engine, facts, timeout_s=30.0, max_bytes=1 << 20)
        return made[engine]

    return get
