"""The step-cost table of the confidence scheduler, profiled once at start-up: seconds of one forward
at a batch token count, measured on throw-away caches with verify-shaped sequences (1 + k tokens each)."""

from __future__ import annotations

import time

from deepinfer.spec.scheduler import StepCostTable
from deepinfer.worker.profile_run import profile_forward


def profile_step_costs(model, backend, block_size: int, k: int, max_tokens: int, repeats: int = 2,
                       layouts=None) -> StepCostTable:
    """Forwards of 1, 2, 4, ... tokens up to max_tokens (at least 2 points); the fastest of `repeats`
    runs per point (the others' noise is the machine's, not the step's)."""
    counts = []
    n = 1
    while n < max_tokens:
        counts.append(n)
        n *= 2
    counts.append(max(max_tokens, 2))
    seconds = []
    for n in counts:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            profile_forward(model, block_size, n, k + 1, n, backend.device, layouts)
            backend.synchronize()
            best = min(best, time.perf_counter() - t0)
        seconds.append(max(best, 1e-6))
    return StepCostTable(counts, seconds)
