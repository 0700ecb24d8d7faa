"""Timing by CUDA-graph replay: decode-size work is launch-bound when run eagerly, so the
kernel benchmarks capture `inner` calls in a graph and time its replays with events."""

from __future__ import annotations

import torch


def graph_ms(fn, inner: int = 1, reps: int = 20, dry_run: bool = False, dry_value: float = 1.0) -> float:
    """Median ms per fn() call over `reps` replays of a graph of `inner` calls.

    dry_run: call fn once (a CPU pass through the benchmark's code paths) and return dry_value."""
    if dry_run:
        fn()
        return dry_value
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile + warm up outside the capture
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return sorted(times)[len(times) // 2] / inner


def rotating_graph_us(fn, copies: int, reps: int = 20, warm: int = 2) -> float:
    """Device µs per call: `reps` calls fn(i % copies) captured in one CUDA graph (i picks one of `copies` input sets,
    e.g. weight copies, so the L2 does not serve them all), replayed three times after one unmeasured replay; the
    first `warm` calls run eagerly on a side stream outside the capture (compiles, the allocator's pools). A Python
    launch costs more than a small GEMM, so timing eager calls would measure the host."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warm):
            fn(i % copies)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i % copies)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return start.elapsed_time(end) * 1000 / (3 * reps)
