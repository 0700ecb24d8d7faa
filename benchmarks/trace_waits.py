"""Where the host blocked on the device in a torch.profiler chrome trace: the CUDA runtime calls that wait
(stream / event / device synchronize, blocking copies) by name, with their count and time, and the device's idle
gaps. A speculative step's phases (spec/step_phases.py) say how long the host took between its marks; this says
which of those milliseconds were the host waiting for the device inside a phase that should not wait.

    python -m benchmarks.trace_waits TRACE.json [TRACE2.json ...]

Traces come from `benchmarks.speculative --profile MODE:CONC --trace-dir DIR` (benchmarks/profile_region.py).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

_DEVICE = {"kernel", "gpu_memcpy", "gpu_memset"}

def _blocks(name: str) -> bool:
    """A CUDA runtime / driver call that makes the host wait for the device: a synchronize, or a copy that is not
    the async form (cudaMemcpy, cuMemcpyDtoH_v2; cudaMemcpyAsync returns at once into pinned memory)."""
    return "Synchronize" in name or ("Memcpy" in name and "Async" not in name)


def summarize(path: str, top: int = 12) -> str:
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if "dur" in e]
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in runtime:
        a = agg[e["name"]]
        a[0] += e["dur"] / 1e3
        a[1] += 1
    dev = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in _DEVICE)
    gaps: list[float] = []
    end = None
    for s, t in dev:
        if end is not None and s > end:
            gaps.append((s - end) / 1e3)
        end = t if end is None else max(end, t)
    span = (dev[-1][1] - dev[0][0]) / 1e3 if dev else 0.0
    big = [g for g in gaps if g > 0.05]
    head = (f"{path}: device span {span:.2f} ms, idle {sum(gaps):.2f} ms in {len(gaps)} gaps "
            f"(gaps > 0.05 ms: {len(big)}, their sum {sum(big):.2f} ms)")
    lines = [head]
    waits = sorted(((n, v) for n, v in agg.items() if _blocks(n)), key=lambda kv: -kv[1][0])
    lines.append("  host waits (CUDA runtime calls that block): "
                 + ("; ".join(f"{n} {v[0]:.2f} ms / {int(v[1])}" for n, v in waits) or "none"))
    busiest = sorted(agg.items(), key=lambda kv: -kv[1][0])[:top]
    lines.append("  runtime calls by time: " + "; ".join(f"{n} {v[0]:.2f} ms / {int(v[1])}" for n, v in busiest))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__)
        return 2
    for p in paths:
        print(summarize(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
