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


_PROBE = """
import torch, triton, triton.language as tl
@triton.jit
def k(p, o):
    n = tl.load(p)
    acc = 0
    for i in range(0, n, 1):
        acc += 1
    tl.store(o, acc)
x = torch.tensor([3], dtype=torch.int32); o = torch.zeros(1, dtype=torch.int32)
k[(1,)](x, o)
assert int(o[0]) == 3
"""


def _interpreter_loops_over_loaded_bounds(env: dict) -> bool:
    """Triton 3.6's interpreter (the H200 image's) cannot take range() bounds from a loaded value
    ('only 0-dimensional arrays can be converted to Python scalars'); the MLA kernels need it."""
    probe = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=120)
    return probe.returncode == 0


def test_kernels_mla_dry_run_prints_its_tables():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    # the dry run starts beside the interpreter probe (both mostly import at first); stopped if the probe fails
    run = subprocess.Popen([sys.executable, "-m", "benchmarks.kernels_mla", "--dry-run"], cwd=ROOT, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if not _interpreter_loops_over_loaded_bounds(env):
            import triton

            pytest.skip(f"Triton {triton.__version__}'s interpreter cannot loop to a loaded bound (the kernels "
                        "themselves run compiled on this machine; CI's Triton runs this dry run)")
        stdout, stderr = run.communicate(timeout=300)
    finally:
        run.kill()
    assert run.returncode == 0, stderr[-3000:]
    assert "attention layer per decode step" in stdout
    assert "MLA decode (latent cache TB/s)" in stdout
