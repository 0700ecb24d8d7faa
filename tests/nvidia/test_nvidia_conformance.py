"""The packaged conformance suite on the nvidia backend: Triton interpreter at tiny shapes on the CPU.

The interpreter's bf16 tl.dot is wrong (the kernels upcast bf16 tiles there),
so the CPU run covers fp32 and fp16; the GPU run (scripts/gpu_run.sh) adds
bf16 at real shapes.
"""

from __future__ import annotations

import torch
from nvidia_testutil import ON_GPU, backend  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.conformance import run_conformance


def test_conformance_tiny_on_nvidia_backend():
    dtypes = (torch.float32, torch.float16, torch.bfloat16) if ON_GPU else (torch.float32, torch.float16)
    report = run_conformance(backend(), shapes="tiny", dtypes=dtypes)
    bad = [r for r in report.rows if r.status in ("fail", "error")]
    assert not bad, report.format_table()
    triton_rows = [r for r in report.rows if r.status == "pass" and "triton" in r.impl]
    assert len(triton_rows) >= 7, report.format_table()
