"""Shared fixtures for tests/engine: one checkpoint per preset and one small tokenizer per session."""

from __future__ import annotations

import pytest

from deepinfer.checkpoints.tokenizer_factory import write_tokenizer


@pytest.fixture(scope="session")
def fake_tokenizer_dir(tmp_path_factory):
    """A tokenizer for the arithmetic fake model (vocab 300 = engine_fakes.VOCAB)."""
    d = tmp_path_factory.mktemp("fake_tok")
    write_tokenizer(str(d), 300)
    return str(d)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> directory of a random-weight checkpoint, made once per session."""
    from deepinfer.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in made:
            d = tmp_path_factory.mktemp(preset.replace("-", "_"))
            make_checkpoint(preset, str(d), seed=0)
            made[preset] = str(d)
        return made[preset]

    return get
