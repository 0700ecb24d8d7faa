"""The grammar bitmask op in the conformance suite (deepinfer/conformance/bitmask_cases.py).

- the oracle itself (backend/native/grammar.py) does what the contract says on every case's inputs, read
  from the bits by brute force: allowed logits untouched, forbidden ones and ids beyond 32 W -inf,
  all-masked rows all -inf, rows outside `rows` untouched (fp32 and bf16);
- the bitwise compare catches a backend that forgets the row index, one that writes a huge negative
  number instead of -inf, and one that lets the padded vocabulary through;
- cpu (native), nvidia (Triton, under the interpreter here), the toy plugin and ascend (over the test-only
  torch_npu fake, in a subprocess) all pass bitwise, and their op_impl / op_coverage name what runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer.backend import OP_NAMES
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.conformance import run_conformance, run_for_device
from deepinfer.conformance.bitmask_cases import OP, bitmask_cases
from deepinfer.conformance.runner import _Reference

ROOT = Path(__file__).resolve().parents[2]
DTYPES = (torch.float32, torch.bfloat16)


def _allowed_by_bits(mask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [M, vocab], read one bit at a time (independent of the op's vectorised unpacking)."""
    m, words = mask.shape
    out = torch.zeros(m, vocab, dtype=torch.bool)
    for i in range(m):
        for t in range(min(vocab, 32 * words)):
            out[i, t] = (int(mask[i, t // 32]) >> (t % 32)) & 1 == 1
    return out


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "bfloat16"])
def test_the_oracle_follows_the_contract(dtype):
    cases = bitmask_cases("tiny")
    assert OP in OP_NAMES and {c.op for c in cases} == {OP}
    saw_all_masked = saw_short_mask = saw_odd_vocab = False
    for index, case in enumerate(cases):
        inputs = case.make(torch.Generator().manual_seed(index), dtype)
        (out,) = case.run(_Reference(), inputs)
        logits, mask, rows = inputs["logits"], inputs["bitmask"], inputs["rows"]
        n, vocab = logits.shape
        rows_l = list(range(n)) if rows is None else rows.tolist()
        allowed = _allowed_by_bits(mask, vocab)
        for j, r in enumerate(rows_l):
            expect = torch.where(allowed[j], logits[r], torch.tensor(float("-inf"), dtype=dtype))
            assert torch.equal(out[r], expect), case.name
            saw_all_masked |= bool(torch.isneginf(out[r]).all())
        others = [r for r in range(n) if r not in rows_l]
        assert torch.equal(out[others], logits[others]), case.name  # unconstrained rows untouched
        saw_short_mask |= 32 * mask.shape[1] < vocab
        saw_odd_vocab |= vocab % 32 != 0
    assert saw_all_masked and saw_short_mask and saw_odd_vocab  # the cases cover what they claim


class _NoRowIndex(CPUBackend):
    name = "no-row-index"

    def apply_token_bitmask(self, logits, bitmask, rows=None):
        return super().apply_token_bitmask(logits, bitmask, None if rows is None else torch.arange(len(rows)))


class _FiniteMinimum(CPUBackend):
    name = "finite-minimum"

    def apply_token_bitmask(self, logits, bitmask, rows=None):
        ref = super().apply_token_bitmask(logits.clone(), bitmask, rows)
        logits.copy_(torch.where(torch.isneginf(ref), torch.finfo(logits.dtype).min, ref))
        return logits


class _PaddingAllowed(CPUBackend):
    name = "padding-allowed"

    def apply_token_bitmask(self, logits, bitmask, rows=None):
        words = (logits.shape[1] + 31) // 32
        if bitmask.shape[1] < words:  # pads the mask with allowed words: the padded vocabulary leaks
            bitmask = torch.cat([bitmask, bitmask.new_full((bitmask.shape[0], words - bitmask.shape[1]), -1)], 1)
        return super().apply_token_bitmask(logits, bitmask, rows)


@pytest.mark.parametrize("backend,failing,num_failing", [
    (_NoRowIndex(), "rows [", 4),  # every case with a row index other than 0..M-1; rows=None cases pass
    (_FiniteMinimum(), "", 6),  # every case: finfo.min is not -inf
    (_PaddingAllowed(), "narrower than the vocabulary", 1)])
def test_the_bitwise_compare_catches_wrong_masks(backend, failing, num_failing):
    report = run_conformance(backend, dtypes=[torch.float32], ops=[OP])
    failed = [r for r in report.rows if r.status == "fail"]
    assert len(failed) == num_failing and not report.ok, report.format_table()
    assert all(failing in r.case and "differ bitwise" in r.reason for r in failed)
    assert all(r.status in ("pass", "fail") for r in report.rows)


def _assert_all_pass(report, impl: str, dtypes=("float32", "bfloat16")) -> None:
    assert report.ok, report.format_table()
    rows = [r for r in report.rows if r.op == OP]
    assert len(rows) == len(bitmask_cases("tiny")) * len(dtypes), report.format_table()
    assert all(r.status == "pass" and r.impl.startswith(impl) for r in rows), report.format_table()


def test_cpu_and_nvidia_match_the_oracle_bitwise():
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    cpu = CPUBackend()
    assert cpu.op_coverage()[OP] == "native"
    _assert_all_pass(run_conformance(cpu, dtypes=DTYPES, ops=[OP]), "native")
    nvidia = NvidiaBackend(device=torch.device("cpu"))  # the Triton kernel, under TRITON_INTERPRET=1 here
    assert nvidia.op_coverage()[OP].startswith("triton")
    _assert_all_pass(run_conformance(nvidia, dtypes=DTYPES, ops=[OP]), "triton")
    # the real-shape cases (DeepSeek vocabularies) build and pass too
    real = run_for_device("cpu", shapes="real", dtypes=[torch.float32], ops=[OP], models=False)
    assert real.ok and len(real.rows) == len(bitmask_cases("real")), real.format_table()


def test_toy_plugin_backend_reports_and_passes(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests" / "plugins" / "toy_backend"))
    try:
        from deepinfer_toy_backend.backend import ToyBackend

        toy = ToyBackend()
        assert toy.op_coverage()[OP] == "native"  # inherited from NativeOps: the Backend default op runs
        report = run_conformance(toy, dtypes=DTYPES, ops=[OP])
        # its caps hold fp32 only, but a sampling op's dtype is the logits', not a compute dtype: bf16 runs too
        assert toy.caps.dtypes == (torch.float32,)
        _assert_all_pass(report, "native")
    finally:
        for name in [m for m in sys.modules if m.startswith("deepinfer_toy_backend")]:
            del sys.modules[name]


def test_ascend_over_the_fake_passes():
    """In a subprocess: the test-only torch_npu fake must not be imported into this process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests" / "ascend" / "fake_torch_npu"),
                                                        os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "check", "--device", "ascend", "--op", OP,
                          "--dtype", "float32", "--dtype", "bfloat16", "--no-models", "--json"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:] + out.stdout[-3000:]
    data = json.loads(out.stdout)
    assert data["backend"] == "ascend" and data["ok"]
    rows = [r for r in data["rows"] if r["op"] == OP]
    assert len(rows) == 2 * len(bitmask_cases("tiny")) and all(r["status"] == "pass" for r in rows), rows
    assert all(r["impl"] == "native" for r in rows)  # no torch_npu op: the Backend default, torch on the NPU
