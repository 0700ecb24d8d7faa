"""`TRITON_INTERPRET=1 deepinfer check --device nvidia` runs the NVIDIA kernels under the Triton interpreter.

BackendInfo.emulation: a backend that is unavailable here but names a stand-in resolves to it only when
named exactly (`--device nvidia`); `auto` and the device types (cpu / cuda / npu) never pick it.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from deepinfer.backend import BackendInfo, hookimpl
from deepinfer.backend import registry as registry_module
from deepinfer.backend.registry import BackendRegistry
from deepinfer.backends.nvidia import plugin as nvidia_plugin
from deepinfer.entrypoints.cli import main
from deepinfer.errors import BackendError

HAS_TRITON = importlib.util.find_spec("triton") is not None
NVIDIA_AVAILABLE = not nvidia_plugin.probe()
# Triton decides interpreter or not when a kernel is defined, so the kernels only run emulated in a
# session that had TRITON_INTERPRET=1 from the start (tests/conftest.py sets it without /dev/nvidiactl).
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
needs_emulation = pytest.mark.skipif(
    NVIDIA_AVAILABLE or not HAS_TRITON or not INTERPRETING,
    reason="needs a machine without a usable GPU, triton, and TRITON_INTERPRET=1 from the session start",
)


@pytest.fixture
def fresh_registry(monkeypatch):
    """The CLI's process-wide registry rebuilt (and its probes rerun) under this test's environment."""
    monkeypatch.setattr(registry_module, "_default", None)
    for name in [k for k in os.environ if k.startswith("DEEPINFER_")]:
        monkeypatch.delenv(name)


class _FakePlugin:
    """Two unavailable backends: one with a stand-in, one without; and an available CPU one."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(BackendInfo(name="fakegpu", backend_class="x:Y", probe=lambda: ["no fake GPU"], device_type="cuda",
                             priority=10, emulation=lambda: "fake interpreter"))
        register(BackendInfo(name="plain", backend_class="x:Y", probe=lambda: ["no plain device"], device_type="cuda",
                             priority=5, emulation=lambda: None))
        register(BackendInfo(name="fakecpu", backend_class="x:Y", probe=lambda: [], device_type="cpu"))


def test_registry_uses_a_stand_in_only_when_named(caplog):
    reg = BackendRegistry(extra_plugins=[_FakePlugin()], load_entry_points=False)
    with caplog.at_level("WARNING", logger="deepinfer"):
        assert reg.resolve("fakegpu").name == "fakegpu"
    assert "fake interpreter" in caplog.text and "no fake GPU" in caplog.text
    assert reg.resolve("auto").name == "fakecpu"  # not the higher-priority emulated one
    with pytest.raises(BackendError, match="no available backend for device 'cuda'") as err:
        reg.resolve("cuda")
    assert "runs emulated when named: fake interpreter" in str(err.value)
    with pytest.raises(BackendError, match="no plain device"):
        reg.resolve("plain")
    probed = {p.info.name: p for p in reg.probe_all()}
    assert probed["fakegpu"].emulation == "fake interpreter" and probed["plain"].emulation is None
    assert probed["fakecpu"].emulation is None and probed["fakecpu"].state() == "available"


class _NpuPlugin:
    """An unavailable npu backend whose stand-in may answer for its device type."""

    @hookimpl
    def deepinfer_register_backends(self, register):
        register(BackendInfo(name="fakenpu", backend_class="x:Y", probe=lambda: ["no npu"], device_type="npu",
                             emulation=lambda: "test fake", emulates_device_type=True))
        register(BackendInfo(name="fakecpu", backend_class="x:Y", probe=lambda: [], device_type="cpu"))


def test_a_device_type_takes_a_stand_in_only_when_the_backend_says_so(caplog):
    reg = BackendRegistry(extra_plugins=[_NpuPlugin()], load_entry_points=False)
    with caplog.at_level("WARNING", logger="deepinfer"):
        assert reg.resolve("npu").name == "fakenpu"
    assert "running 'fakenpu' emulated: test fake" in caplog.text
    assert reg.resolve("auto").name == "fakecpu"  # auto never takes a stand-in
    # without the flag (the cuda one above) the device type still refuses
    reg2 = BackendRegistry(extra_plugins=[_FakePlugin()], load_entry_points=False)
    with pytest.raises(BackendError, match="no available backend for device 'cuda'"):
        reg2.resolve("cuda")


def test_nvidia_emulation_needs_the_interpreter_and_triton(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert nvidia_plugin.emulation() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert nvidia_plugin.emulation() is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert nvidia_plugin.emulation() == ("Triton interpreter on the CPU (TRITON_INTERPRET=1)" if HAS_TRITON else None)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else real_find_spec(name, *a))
    assert nvidia_plugin.emulation() is None


@pytest.mark.skipif(NVIDIA_AVAILABLE or not HAS_TRITON, reason="checks a machine where nvidia is emulated only")
def test_auto_and_cuda_never_pick_emulated_nvidia(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    reg = BackendRegistry()
    assert reg.probe("nvidia").emulation
    assert reg.resolve("nvidia").name == "nvidia"
    assert reg.resolve("auto").name != "nvidia"
    with pytest.raises(BackendError, match="no available backend for device 'cuda'"):
        reg.resolve("cuda")


@needs_emulation
def test_check_nvidia_runs_under_the_interpreter(monkeypatch, capsys, fresh_registry):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    rc = main(["check", "--device", "nvidia", "--op", "rms_norm", "--no-models", "--json"])
    out = capsys.readouterr()
    assert rc == 0, out.out[-3000:] + out.err[-3000:]
    report = json.loads(out.out)
    assert report["ok"] and report["backend"] == "nvidia" and report["device"] == "cpu"
    assert report["counts"]["pass"] > 0 and report["counts"]["fail"] == report["counts"]["error"] == 0
    assert {row["impl"] for row in report["rows"]} == {"triton"}


@needs_emulation
def test_backends_listing_names_the_stand_in(monkeypatch, capsys, fresh_registry):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert main(["backends"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("nvidia ")]
    assert "unavailable: " in line
    assert line.endswith("; runs emulated when named: Triton interpreter on the CPU (TRITON_INTERPRET=1)"), line
    assert main(["backends", "--json"]) == 0
    (entry,) = [e for e in json.loads(capsys.readouterr().out) if e["name"] == "nvidia"]
    assert not entry["available"] and entry["emulation"].startswith("Triton interpreter")


@pytest.mark.skipif(NVIDIA_AVAILABLE, reason="checks the failure on a machine without a usable GPU")
def test_without_the_interpreter_the_name_fails_with_the_probe_reasons(monkeypatch, capsys, fresh_registry):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rc = main(["check", "--device", "nvidia", "--op", "rms_norm", "--no-models"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "no available backend for device 'nvidia'" in err and "Traceback" not in err
    for reason in nvidia_plugin.probe():
        assert reason in err, (reason, err)
    assert "runs emulated" not in err
