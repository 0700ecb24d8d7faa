"""Where one region of a benchmark spends its time: device kernels (torch.profiler / CUPTI) and host Python
(cProfile), printed as short tables so a lent GPU call brings the answer back in its output tail.

Used by benchmarks that measure a whole request rather than a decode step (`benchmarks.speculative --profile`,
`benchmarks.kv_tiers_ttft --profile`); `benchmarks.profile_step` stays the tool for plain decode steps.
`fn` is run once under each profiler (twice in all), so it must be repeatable: a fresh cell of requests, or a
prefix hit that hits again.
"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import re
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from benchmarks.profile_step import _union_us

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}

# kernel classes by name, first match wins (`kernel_class`): what a quantized scheme can speed up (the GEMMs) against
# what it cannot (attention, routing, norms, glue), for the ceiling benchmarks/quant_summary.py prints
KERNEL_CLASSES = (
    ("moe_gemm", re.compile(r"_aligned_gemm|_direct_gemm|fused_moe|moe_gemv")),
    ("act_quant", re.compile(r"act_quant|silu_mul_quant|rms_norm_fp8")),
    ("dense_gemm", re.compile(r"nvjet|gemm|gemv|cutlass|xmma|cublas|sm90_|matmul", re.IGNORECASE)),
    ("attention", re.compile(r"_prefill_kernel|mla|attention|flash", re.IGNORECASE)),
)


def kernel_class(name: str) -> str:
    """The class of a device kernel by its name (KERNEL_CLASSES), "other" where none matches; copies and memsets are
    "other" too."""
    for cls, pattern in KERNEL_CLASSES:
        if pattern.search(name):
            return cls
    return "other"


def device_profile(fn: Callable[[], object], trace_path: str) -> dict:
    """fn under torch.profiler: wall ms, device-busy ms (the union of kernel / copy intervals), the kernel sum
    and the top kernels by time with their launch counts."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - t)
    prof.export_chrome_trace(trace_path)
    with open(trace_path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in _DEVICE_CATS and "dur" in e]
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in events:
        a = agg[e["name"][:80]]
        a[0] += e["dur"] / 1e3
        a[1] += 1
    top = sorted(agg.items(), key=lambda kv: -kv[1][0])[:20]
    classes: dict[str, float] = defaultdict(float)
    for e in events:
        classes[kernel_class(e["name"]) if e.get("cat") == "kernel" else "other"] += e["dur"] / 1e3
    return {"wall_ms": wall, "device_busy_ms": _union_us([(e["ts"], e["ts"] + e["dur"]) for e in events]) / 1e3,
            "kernel_sum_ms": sum(e["dur"] for e in events) / 1e3, "launches": len(events),
            "classes_ms": {k: round(v, 3) for k, v in sorted(classes.items())},
            "top": [(name, round(ms, 3), int(n)) for name, (ms, n) in top]}


def host_profile(fn: Callable[[], object], lines: int = 30) -> str:
    """fn under cProfile: the functions with the most cumulative time (the host's share of the region)."""
    pr = cProfile.Profile()
    pr.enable()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    pr.disable()
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("cumulative").print_stats(lines)
    buf.write("\n-- by own time --\n")
    stats.sort_stats("tottime").print_stats(lines // 2)
    return buf.getvalue()


def profile_region(label: str, fn: Callable[[], object], trace_path: str, host_lines: int = 30,
                   setup: Callable[[], object] | None = None) -> dict:
    """Print the device table and the host table of fn (run twice) under `label`; return the device dict.
    `setup`, when given, runs before each of the two runs, outside the profilers."""
    if setup is not None:
        setup()
    dev = device_profile(fn, trace_path)
    print(f"\n## profile: {label}: wall {dev['wall_ms']:.2f} ms, device busy {dev['device_busy_ms']:.2f} ms, "
          f"kernel sum {dev['kernel_sum_ms']:.2f} ms, {dev['launches']} launches", flush=True)
    for name, ms, n in dev["top"]:
        print(f"  {ms:9.3f} ms {n:6d}x  {name}")
    print("  by class: " + ", ".join(f"{k} {v:.1f} ms" for k, v in dev["classes_ms"].items()))
    print(f"## host (cProfile) of {label}:")
    if setup is not None:
        setup()
    text = host_profile(fn, host_lines)
    # keep the tables, drop pstats' preamble lines
    print("\n".join(ln for ln in text.splitlines() if ln.strip() and "function calls" not in ln
                    and not ln.startswith("Ordered by")), flush=True)
    return {"label": label, **dev}
