"""Shared fixtures for tests/parallel (the checkpoints: tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def failure_scenarios(checkpoint) -> dict:
    """The parallel engine's failure and API-review scenarios (tests/parallel/engine_script.py), all five at once:
    they mostly wait (on timeouts, on each other's ranks), so together they cost about what the slowest does."""
    from script_runner import run_scripts

    path = checkpoint("tiny-v2-lite")
    layout = {"data_parallel_size": 2, "enable_expert_parallel": True}
    runs = {"review": ("review", path, dict(layout)), "kill_at_start": ("kill_at_start", path, dict(layout)),
            "idle_hang": ("idle_hang", path, dict(layout)),
            "kill": ("kill", path, {"data_parallel_size": 2, "dist_timeout_s": 10.0}),
            "hang": ("hang", path, {"data_parallel_size": 2, "dist_timeout_s": 4.0})}
    return dict(zip(runs, run_scripts(*runs.values(), timeout=180.0)))
