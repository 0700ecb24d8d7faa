"""benchmarks/spec_policy_sim.py's `--policy FIELD=VALUE` A/B: the field reaches the adaptive policy (a run without
challenges makes none where the default makes some), and a name SlotPolicy lacks or a value that is no literal is
refused naming it."""

from __future__ import annotations

import pytest

from benchmarks import spec_policy_sim as sim


def _run(fields: dict | None) -> dict:
    return sim.simulate(sim.MODELS["h200-b4"], "adaptive", 3000, seed=0, host_factor=0.0, max_tokens=128, repeats=3,
                        policy_fields=fields)


def test_policy_fields_reach_the_adaptive_policy():
    assert _run(None)["decisions"].get("challenge", 0) > 0  # (so the A/B below can fail)
    assert _run({"challenge_every": 0})["decisions"].get("challenge", 0) == 0


def test_unknown_field_and_bad_value_are_refused():
    with pytest.raises(SystemExit, match="--policy no_such_knob: SlotPolicy has no such field"):
        _run({"no_such_knob": 1})
    with pytest.raises(SystemExit, match="not a Python literal"):
        sim.main(["--model", "h200-b4", "--steps", "10", "--policy", "time_fit=maybe"])
    with pytest.raises(SystemExit, match="expected FIELD=VALUE"):
        sim.main(["--model", "h200-b4", "--steps", "10", "--policy", "time_fit"])
