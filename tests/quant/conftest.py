"""Shared fixtures of the quantization tests: one tiny bf16 checkpoint and its AWQ / GPTQ copies per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_v3_dir(tmp_path_factory) -> str:
    from deepinfer.checkpoints import make_checkpoint

    out = str(tmp_path_factory.mktemp("tiny-v3"))
    make_checkpoint("tiny-v3", out, seed=3)
    return out


@pytest.fixture(scope="session")
def int4_dirs(tiny_v3_dir, tmp_path_factory) -> dict:
    from deepinfer.checkpoints.awq_writer import write_int4_checkpoint

    dirs = {}
    for method in ("awq", "gptq"):
        out = str(tmp_path_factory.mktemp(f"tiny-v3-{method}"))
        prefixes = write_int4_checkpoint(tiny_v3_dir, out, method)
        dirs[method] = (out, prefixes)
    return dirs
