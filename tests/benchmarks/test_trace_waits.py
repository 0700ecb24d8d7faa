"""benchmarks/trace_waits.py on a hand-made chrome trace: the host's blocking CUDA calls are summed by name, calls
that do not block are not counted as waits, and the device's idle gaps between (overlapping) kernels are measured."""

from __future__ import annotations

import json

from benchmarks.trace_waits import summarize


def test_waits_and_idle_gaps_of_a_hand_made_trace(tmp_path):
    events = [
        {"cat": "kernel", "name": "a", "ts": 0, "dur": 100},
        {"cat": "kernel", "name": "b", "ts": 50, "dur": 100},  # overlaps a: no gap
        {"cat": "gpu_memcpy", "name": "DtoH", "ts": 250, "dur": 50},  # 100 us after b ends
        {"cat": "kernel", "name": "c", "ts": 320, "dur": 30},  # 20 us gap
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 150, "dur": 90},
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 300, "dur": 10},
        {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": 0, "dur": 5},
        {"cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 240, "dur": 4},
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 400},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    head, waits, busiest = summarize(str(path)).splitlines()
    assert "device span 0.35 ms, idle 0.12 ms in 2 gaps (gaps > 0.05 ms: 1, their sum 0.10 ms)" in head
    assert waits.endswith("cudaStreamSynchronize 0.10 ms / 2")  # the only blocking call (cudaMemcpyAsync is not)
    assert "cudaLaunchKernel 0.01 ms / 1" in busiest and "aten::mm" not in busiest
