"""Project-wide pytest setup, kept minimal: CPU thread count and the `gpu` marker skip.

Markers (`gpu`, `slow`) are declared in pyproject.toml. Area fixtures live in
their own tests/<area>/ directories.
"""

from __future__ import annotations

import os

import pytest
import torch

# CI machines have 2 cores; more intra-op threads than cores only thrash.
torch.set_num_threads(max(1, min(int(os.environ.get("DEEPINFER_TEST_THREADS", "2")), os.cpu_count() or 1)))


def pytest_collection_modifyitems(config, items):
    # torch.cuda.is_available() asks the driver for a device count; it creates no context.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
