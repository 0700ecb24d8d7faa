"""Registration without torch_npu: the probe's reasons, no torch_npu import from `import deepinfer` or the
probe (fresh interpreters, the fake on the path), `deepinfer backends`; then, in subprocesses with the
fake, `deepinfer check --device ascend` and greedy generation equal to the cpu backend."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from ascend_testutil import fake_env

from deepinfer.backend.registry import BackendRegistry

HERE = Path(__file__).resolve().parent


def test_probe_gives_precise_reasons_here():
    probed = BackendRegistry().probe("ascend")
    assert not probed.available and probed.info.device_type == "npu"
    text = "; ".join(probed.reasons)
    assert "torch_npu not importable" in text and "no /dev/davinci device" in text
    assert probed.emulation is None  # no fake on the path: nothing to stand in


def test_import_and_probe_never_import_torch_npu_even_when_it_is_findable():
    code = ("import sys, deepinfer; from deepinfer.backend.registry import BackendRegistry; "
            "r = BackendRegistry(); p = r.probe('ascend'); "
            "import deepinfer.backends.ascend.backend; "
            "print(p.emulation is not None, 'torch_npu' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], env=fake_env(), capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["True", "False"]


def test_backends_listing_says_unavailable_and_why(capsys):
    from deepinfer.entrypoints.cli import main

    assert main(["backends"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ascend"))
    assert "unavailable: torch_npu not importable" in line and "no /dev/davinci device" in line


def test_check_device_npu_passes_over_the_fake():
    ops = ["--op", "rms_norm", "--op", "route", "--op", "moe", "--op", "silu_and_mul"]
    out = subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "check", "--device", "npu",
                          "--no-models", *ops], env=fake_env(), capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 failed, 0 errors" in out.stdout and "npu_moe_gating_top_k" in out.stdout


def test_greedy_generation_equals_the_cpu_backend_with_graphs_on_and_off():
    presets = ["tiny-v3-ascend-mla", "tiny-v2-lite", "tiny-v3"]
    out = subprocess.run([sys.executable, str(HERE / "e2e_generate.py"), *presets], env=fake_env(),
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    for preset in presets:
        eager, graphs, cpu, replays = result[preset]
        assert eager == cpu and graphs == cpu, preset
        # decode graphs replay only where every layer is on the fused ops (the stock tiny widths fall back to
        # native MLA, and the runner sends those batches to the eager path)
        assert (replays > 0) == (preset == "tiny-v3-ascend-mla"), (preset, replays)
