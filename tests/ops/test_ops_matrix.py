"""The ops matrix (`deepinfer check --list-ops`): every op of the contract has a row, a backend's
`supports` reasons show up as refusals, and docs/ops.md is what the command prints for cpu, nvidia and ascend."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer.backend import OP_NAMES, BackendCaps, MLASpec, OpSpec
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.conformance.ops_matrix import cell, matrix_rows

ROOT = Path(__file__).resolve().parents[2]


def test_every_op_has_a_row():
    assert {r.op for r in matrix_rows()} == set(OP_NAMES)


class _Picky(CPUBackend):
    """bf16 only, no fp8 linears, and an MLA kernel that needs 64 heads."""

    name = "picky"

    @property
    def caps(self) -> BackendCaps:
        return replace(super().caps, dtypes=(torch.bfloat16,), quant_schemes=("none",))

    def supports(self, op: OpSpec) -> list[str]:
        reasons = super().supports(op)
        if op.op == "mla_attention" and isinstance(op.spec, MLASpec) and op.spec.num_heads != 64:
            reasons.append("needs 64 heads")
        return reasons

    def op_impl(self, op: OpSpec) -> str:
        return "picky-kernel" if op.op == "rms_norm" else super().op_impl(op)


def test_cells_show_the_implementation_per_dtype_and_the_reasons():
    rows = {(r.op, r.variant): r for r in matrix_rows()}
    be = _Picky()
    norm = cell(be, rows[("rms_norm", "D=7168")])
    assert norm.startswith("picky-kernel (bfloat16)") and "✗ float16: dtype float16 is not in the backend's caps" in norm
    fp8 = cell(be, rows[("linear:fp8_block", "e4m3, 128x128 block scales")])
    assert "quant scheme 'fp8_block'" in fp8 and "native" not in fp8
    mla = cell(be, next(r for r in matrix_rows() if r.op == "mla_attention"))
    assert "needs 64 heads" in mla and mla.count("✗") == 3
    assert cell(CPUBackend(), rows[("rms_norm", "D=7168")]) == "native"


REGENERATE = ("PYTHONPATH=tests/ascend/fake_torch_npu TRITON_INTERPRET=1 deepinfer check --list-ops --format md "
              "--backends cpu,nvidia,ascend > docs/ops.md")


def test_docs_ops_md_is_current():
    """The command of REGENERATE, in a subprocess: the ascend column needs the test-only torch_npu fake on the
    path, which must never be imported into this process."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "ascend" / "fake_torch_npu"),
                                          os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "check", "--list-ops", "--format", "md",
                          "--backends", "cpu,nvidia,ascend"], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "not constructed here" not in out.stdout, out.stdout[-2000:]
    committed = (ROOT / "docs" / "ops.md").read_text(encoding="utf-8")
    assert committed == out.stdout, f"docs/ops.md is stale: {REGENERATE}"


def test_cli_prints_the_matrix(capsys):
    from deepinfer.entrypoints.cli import main

    assert main(["check", "--list-ops", "--backends", "cpu", "--format", "text"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: available") and "mla_attention" in out and "all_to_all" in out
