"""The packaged conformance suite on the nvidia backend: Triton interpreter at tiny shapes on the CPU.

The interpreter's bf16 tl.dot is wrong (the kernels upcast bf16 tiles there),
so the CPU run covers fp32 and fp16; the GPU run (scripts/gpu_run.sh) adds
bf16 at real shapes. On the CPU the MoE cases run in fp16 only: they were
~40% of this test's interpreter time, and TritonMoE in fp32 is compared with
NativeMoE by tests/nvidia/test_nvidia_moe.py (softmax greedy and noaux_tc, T=9)
and test_nvidia_moe_fusion.py (direct and aligned schedules, shared experts
folded or added, forward_hidden), the routers alone by test_route_matches_native.
"""

from __future__ import annotations

import torch
from nvidia_testutil import ON_GPU, backend  # noqa: I001  (sets TRITON_INTERPRET)

from deepinfer.backend.native import OP_NAMES
from deepinfer.conformance import run_conformance


def test_conformance_tiny_on_nvidia_backend():
    if ON_GPU:
        reports = [run_conformance(backend(), shapes="tiny", dtypes=(torch.float32, torch.float16, torch.bfloat16))]
    else:
        reports = [run_conformance(backend(), shapes="tiny", dtypes=(torch.float32, torch.float16),
                                   ops=[op for op in OP_NAMES if op != "moe"]),
                   run_conformance(backend(), shapes="tiny", dtypes=(torch.float16,), ops=["moe"])]
    rows = [r for report in reports for r in report.rows]
    tables = "\n".join(report.format_table() for report in reports)
    bad = [r for r in rows if r.status in ("fail", "error")]
    assert not bad, tables
    triton_rows = [r for r in rows if r.status == "pass" and "triton" in r.impl]
    assert len(triton_rows) >= 7, tables
    assert any(r.op == "moe" and r.status == "pass" and "triton" in r.impl for r in rows), tables
