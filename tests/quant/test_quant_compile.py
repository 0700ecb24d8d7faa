"""The dense quantized-linear kernels compile for sm_90 (no GPU: Triton's own ptxas) in a subprocess without
TRITON_INTERPRET, without spilling, within Hopper's shared memory, and on the paths meant for them: the fp8 GEMM
on fp8 wgmma (QGMMA) at BLOCK_M >= 64, the int4 GEMM on bf16 wgmma (HGMMA) at BLOCK_M >= 64, and the
contiguous-group int4 tile with no per-element integer -> float conversion (a handful of I2F for the scales)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="triton is not installed")

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


@pytest.mark.skipif(not PTXAS.exists(), reason="this triton has no bundled ptxas (no NVIDIA backend)")
def test_quant_kernels_compile_for_sm90_on_their_paths():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this tree, not an installed copy
    script = Path(__file__).with_name("quant_sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["kernel"]: r for r in (json.loads(ln) for ln in run.stdout.splitlines() if ln.startswith("{"))}
    assert len(rows) == 9, run.stdout
    for row in rows.values():
        assert row["stack"] <= 16 and row["LDL"] == 0 and row["shared"] <= 227 * 1024 and row["regs"] <= 255, row
    for label, row in rows.items():
        if label.startswith("fp8_gemm") and "BM=16" not in label:
            assert row["QGMMA"] > 0, row  # fp8 tensor cores
        if label.startswith("int4_gemm") and "BM=128" in label:
            assert row["HGMMA"] > 0, row
        if label.startswith(("int4_gemm gidx=False", "int4_dequant")):
            assert row["I2F"] <= 8, row  # the 2^23 trick: no conversion per weight
