"""Self-resetting arrival counters for the invariant kernels' "last program folds" epilogues.

A kernel that spreads a fixed split of one reduction over several programs (gemm.py's K slices, moe_gemm.py's,
mla.py's context splits) lets each program write its partial state, then bump a per-tile counter; the program
that sees the count reach the number of parts folds them in part order (0, 1, ...) and resets the counter to 0.
The counter decides only WHICH program folds, never the order of the additions, so the bits are those of the
same fold done in one program (the serial schedule); the atomics carry no arithmetic.

The buffer is zeroed once, allocated before any graph capture (the first eager call, as the graph runner's
warm-up makes it), never replaced while a captured graph may hold its pointer, and shared by launches that run
in stream order (the invariant path runs on one stream). A launch needs one counter per tile; callers bound it
by COUNTERS (the parallel schedules are picked only for small grids).
"""

from __future__ import annotations

import torch

from deepinfer.errors import BackendError

COUNTERS = 1 << 16
_BUFFERS: dict[str, torch.Tensor] = {}


def tile_counters(device: torch.device, n: int) -> torch.Tensor:
    """COUNTERS zeroed int32 counters on `device` (n: how many this launch needs, <= COUNTERS)."""
    if n > COUNTERS:
        raise BackendError(f"invariant kernels: {n} tile counters asked for, {COUNTERS} exist")
    key = str(device)
    buf = _BUFFERS.get(key)
    if buf is None:
        buf = _BUFFERS[key] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf
