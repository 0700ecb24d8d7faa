"""The conformance suite: every backend op against the torch-native oracle, with coverage.

`deepinfer check --device X` calls `run_for_device` (with `--world-size N`, `run_collectives`: the
collectives on N local gloo ranks); pytest calls
`run_conformance` on the cpu backend (and on NVIDIA kernels under
TRITON_INTERPRET=1).
"""

from deepinfer.conformance.cases import Case, cases_for
from deepinfer.conformance.collectives import CollectiveReport, CollectiveRow, run_collectives
from deepinfer.conformance.report import ConformanceReport, ConformanceRow
from deepinfer.conformance.runner import TOLERANCES, run_conformance, run_for_device

__all__ = [
    "Case",
    "CollectiveReport",
    "CollectiveRow",
    "ConformanceReport",
    "ConformanceRow",
    "TOLERANCES",
    "cases_for",
    "run_collectives",
    "run_conformance",
    "run_for_device",
]
