"""benchmarks/quant_gemm.py's code paths run on the CPU (--dry-run: tiny shapes, Triton interpreter, no timing):
the GPU call that times them should not be the first place a typo shows up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = Path(__file__).resolve().parents[2]


def test_quant_gemm_dry_run_prints_its_tables():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "benchmarks.quant_gemm", "--dry-run"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "dry run (CPU, interpreter)" in out and "routed experts (4 x [2x128, 128], top-2)" in out
    for shape, m in (("q_proj", 1), ("q_proj", 70), ("dense_down", 70)):
        assert any(line.split()[:2] == [shape, str(m)] for line in out.splitlines()), out
    assert sum(line.split()[:1] in (["1"], ["40"]) for line in out.splitlines()) == 2, out  # both MoE rows


def test_quant_gemm_dry_run_sweeps_tiles_and_k_splits():
    """--sweep --splits: for each dense shape and M the best (tile, split) with x quantized apart and inside the GEMM,
    and the int4 tile; --shapes keeps only the shapes named."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "benchmarks.quant_gemm", "--dry-run", "--only", "dense", "--sweep",
                          "--splits", "1,2", "--shapes", "dense_down"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    assert not any(line.split()[:1] == ["q_proj"] for line in lines)
    for key in ("fp8_sep", "fp8_fused", "int4"):
        assert sum(f"best {key} tile" in line and " split " in line for line in lines) == 2, run.stdout


def test_moe_tile_sweep_dry_run_names_each_gemms_default(tmp_path):
    """benchmarks/moe_tile_sweep.py --dry-run: every tile row and one summary per (scheme, schedule, tokens, GEMM),
    each aligned summary with the rows the engine would run that GEMM at (the interpreter's 16 for both)."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = tmp_path / "sweep.jsonl"
    run = subprocess.run([sys.executable, "-m", "benchmarks.moe_tile_sweep", "--dry-run", "--schemes",
                          "bf16,fp8_w8a8", "--group-ms", "0,8", "--json", str(out)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    aligned_rows = [r for r in rows if not r.get("summary") and r["schedule"] == "aligned"]
    assert aligned_rows and {r["cfg"]["group_m"] for r in aligned_rows} == {0, 8}  # --group-ms: each tile twice
    summaries = [r for r in rows if r.get("summary")]
    assert {(r["scheme"], r["schedule"], r["gemm"]) for r in summaries} == {
        (s, sched, g) for s in ("bf16", "fp8_w8a8") for sched in ("direct", "aligned") for g in ("gate_up", "down")}
    assert all(r["default_block_m"] == 16 for r in summaries if r["schedule"] == "aligned")
    assert any(not r.get("summary") and r["scheme"] == "fp8_w8a8" and r["gemm"] == "down" for r in rows)
