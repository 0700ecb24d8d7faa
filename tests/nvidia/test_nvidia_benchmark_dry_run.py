"""benchmarks/kernels_mla.py's code paths run on the CPU (--dry-run, Triton interpreter): the GPU call
that times them should not be the first place a typo shows up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = Path(__file__).resolve().parents[2]


def test_kernels_mla_dry_run_prints_its_tables():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "benchmarks.kernels_mla", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "attention layer per decode step" in run.stdout
    assert "MLA decode (latent cache TB/s)" in run.stdout
