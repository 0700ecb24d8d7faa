"""Where the test-only fake torch_npu lives, and a subprocess environment that puts it on the path."""

from __future__ import annotations

import os
from pathlib import Path

FAKE_DIR = str(Path(__file__).resolve().parent / "fake_torch_npu")


def fake_env() -> dict[str, str]:
    """Environment for a subprocess that imports the fake torch_npu (and runs Triton interpreted)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([FAKE_DIR, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_INTERPRET", "1")
    return env
