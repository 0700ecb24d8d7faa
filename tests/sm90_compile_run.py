"""Run one of the sm_90 compile scripts (tests/nvidia/*_sm90_compile.py, tests/quant/quant_sm90_compile.py) the way
their tests do: a subprocess of this tree without TRITON_INTERPRET (the scripts compile for a GPU target with
Triton's own ptxas; no GPU needed), then its JSON lines (one per kernel) parsed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason="this triton has no bundled ptxas (no NVIDIA backend)")


def run_compile_script(script: Path, drop_env: tuple[str, ...] = ()) -> tuple[list[dict], str]:
    """(the rows the script printed, its stdout); fails the test with its stderr if it failed. drop_env: more
    variables to unset (tile overrides that would change what is compiled)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", *drop_env)}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # this tree, not an installed copy
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300,
                         check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")], run.stdout
