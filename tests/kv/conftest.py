"""Fixtures for tests/kv: one random-weight checkpoint per preset per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def kv_checkpoint(tmp_path_factory):
    """kv_checkpoint(preset) -> directory of a random-weight checkpoint, made once per session."""
    from deepinfer.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in made:
            d = tmp_path_factory.mktemp(preset.replace("-", "_"))
            make_checkpoint(preset, str(d), seed=0)
            made[preset] = str(d)
        return made[preset]

    return get
