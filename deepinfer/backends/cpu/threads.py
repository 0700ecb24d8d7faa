"""Intra-op threads of the `cpu` backend (docs/performance.md, "CPU threads").

DEEPINFER_CPU_THREADS=N sets torch's intra-op threads to N when the backend is built; 0 leaves
torch's setting alone. Unset: 1, unless OMP_NUM_THREADS says otherwise (then torch already follows
it). One thread because the cpu backend's work at small-model shapes is many small ops: a second
OpenMP thread adds a fork / join per op for little arithmetic, and when another process holds a
core the team's barrier waits on a descheduled thread (and its spin-waiting takes the core from
that process), which is what made the same workload's time vary 20x beside a busy neighbour.
"""

from __future__ import annotations

import torch

from deepinfer import envs

DEFAULT_THREADS = 1


def wanted_threads() -> int | None:
    """The thread count to set, or None to leave torch's own."""
    n = envs.CPU_THREADS.get()
    if n is not None:
        return None if n == 0 else n
    if envs.OMP_NUM_THREADS.is_set():
        return None  # the user's OpenMP setting; torch follows it already
    return DEFAULT_THREADS


def configure_threads() -> int:
    """Apply wanted_threads() (torch.set_num_threads is process-wide); the count torch now uses."""
    n = wanted_threads()
    if n is not None and torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return torch.get_num_threads()
