"""One rank's backend with the layout's communicators installed (tests run inside run_local_ranks)."""

from __future__ import annotations


def rank_backend(tp: int, dp: int, ep: bool, rank: int):
    from deepinfer.backends.cpu.backend import CPUBackend
    from deepinfer.parallel.groups import build_communicators
    from deepinfer.parallel.layout import ParallelLayout

    backend = CPUBackend()
    backend.install_communicators(build_communicators(ParallelLayout(tp, dp, ep), rank, backend))
    return backend
