"""The MLA decode kernel over an fp8 KV cache compiles for sm_90 (no GPU needed: Triton's own ptxas), its dots in
bf16 and in fp16, at V2-Lite's batch-1 and batch-256 launches (mla_sm90_compile.py, in a subprocess without
TRITON_INTERPRET). Recorded on 2026-12-04 (Triton 3.9 on the CPU): the bf16-dot kernel already spills at batch 256
(168 bytes of stack at 255 registers; docs/quantization.md "fp8 KV cache"); the fp16 dots must not add more than
a few bytes to it."""

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
def test_mla_decode_fp8_cache_compiles_for_sm90_in_both_dot_dtypes():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this tree, not an installed copy
    script = Path(__file__).with_name("mla_sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["kernel"]: r for r in (json.loads(line) for line in run.stdout.splitlines() if line.startswith("{"))}
    assert len(rows) == 4, run.stdout
    for launch in ("b1", "b256"):
        bf16, fp16 = (rows[f"mla_decode fp8 cache, {dot} dots, {launch}"] for dot in ("bf16", "fp16"))
        assert fp16["stack"] <= bf16["stack"] + 16, (bf16, fp16)
