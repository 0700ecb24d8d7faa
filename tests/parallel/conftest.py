"""Shared fixtures for tests/parallel: one random-weight checkpoint per preset per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory):
    """checkpoint(preset) -> directory of a random-weight checkpoint, made once per session."""
    from deepinfer.checkpoints import make_checkpoint

    made: dict[str, str] = {}

    def get(preset: str) -> str:
        if preset not in made:
            d = tmp_path_factory.mktemp(preset.replace("-", "_"))
            make_checkpoint(preset, str(d), seed=0)
            made[preset] = str(d)
        return made[preset]

    return get


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
