"""The dense quantized-linear kernels compile for sm_90 (no GPU: Triton's own ptxas) in a subprocess without
TRITON_INTERPRET, without spilling, within Hopper's shared memory, and on the paths meant for them: the fp8 GEMM
on fp8 wgmma (QGMMA) at BLOCK_M >= 64, the int4 GEMM on bf16 wgmma (HGMMA) at BLOCK_M >= 64, and the
contiguous-group int4 tile with no per-element integer -> float conversion (a handful of I2F for the scales)."""

from __future__ import annotations

from pathlib import Path

from sm90_compile_run import needs_ptxas, run_compile_script


@needs_ptxas
def test_quant_kernels_compile_for_sm90_on_their_paths():
    found, out = run_compile_script(Path(__file__).with_name("quant_sm90_compile.py"))
    rows = {r["kernel"]: r for r in found}
    assert len(rows) == 11, out
    for row in rows.values():
        assert row["stack"] <= 16 and row["LDL"] == 0 and row["shared"] <= 227 * 1024 and row["regs"] <= 255, row
    for label, row in rows.items():
        if label.startswith("fp8_gemm") and "BM=16" not in label:
            assert row["QGMMA"] > 0, row  # fp8 tensor cores
        if label.startswith("int4_gemm") and "BM=128" in label:
            assert row["HGMMA"] > 0, row
        if label.startswith(("int4_gemm gidx=False", "int4_dequant")):
            assert row["I2F"] <= 8, row  # the 2^23 trick: no conversion per weight
