"""Fixtures the CLI tests share: a tiny checkpoint made once, and an environment without DEEPINFER_*."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_deepinfer_env(monkeypatch):
    """No DEEPINFER_* variable from the caller's shell leaks into a CLI run."""
    for name in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(name)


@pytest.fixture(scope="session")
def tiny_cli_ckpt(tmp_path_factory) -> str:
    from deepinfer.checkpoints import make_checkpoint

    path = tmp_path_factory.mktemp("cli") / "tiny-v2-lite"
    make_checkpoint("tiny-v2-lite", str(path))
    return str(path)
