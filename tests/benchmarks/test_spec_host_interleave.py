"""benchmarks/spec_host.py --interleave: every mode's engine at once, cells round-robin, each phase's median us a step
and each mode's difference from the first (what docs/speculative.md quotes for the adaptive mode's host work)."""

from __future__ import annotations

import sys
import tempfile

import pytest

from benchmarks import spec_host
from deepinfer.checkpoints.tokenizer_factory import write_tokenizer
from deepinfer.spec.step_phases import LAUNCH_PARTS, PHASES


def test_interleaved_cells_give_every_phase_per_mode_and_the_differences(capsys):
    with tempfile.TemporaryDirectory() as tok:
        write_tokenizer(tok, spec_host.VOCAB)
        medians = spec_host.interleaved(tok, 1, ["k1", "adaptive-k5"], 16, 2)
    assert list(medians) == ["k1", "adaptive-k5"]
    for rows in medians.values():
        assert set(PHASES) <= set(rows) and "total" in rows and "steps" not in rows
        assert all(v >= 0 for v in rows.values())
        assert rows["total"] == pytest.approx(sum(rows[p] for p in PHASES), rel=0.2)  # (medians of each, not of sums)
        assert set(rows) - set(PHASES) - {"total"} <= set(LAUNCH_PARTS)
    spec_host.print_interleaved(1, medians)
    lines = capsys.readouterr().out.splitlines()
    assert "adaptive-k5 - k1" in lines[0]
    row = next(line.split() for line in lines[1:] if line.split()[1] == "deferred")
    a, b, diff = (float(x) for x in row[2:5])
    assert diff == pytest.approx(b - a, abs=0.011)


def test_interleave_refuses_modes_without_phases(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["spec_host", "--modes", "off", "k5", "--interleave", "2"])
    with pytest.raises(SystemExit):
        spec_host.main()
    assert "--interleave" in capsys.readouterr().err
