"""A third-party backend, found through pluggy and through a real entry point, runs the engine.

The toy backend (tests/plugins/toy_backend) is an outside package: NativeOps +
Backend under a new name. Nothing in deepinfer knows it; selecting it must work
by `EngineConfig(device="toy")`, `DEEPINFER_DEVICE=toy` and `--device toy`.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer.backend.registry import BackendRegistry
from deepinfer.errors import BackendError

TOY_SRC = Path(__file__).resolve().parent / "toy_backend"


def write_dist_info(site: Path) -> Path:
    """What `pip install tests/plugins/toy_backend` would leave in site-packages, minus the code."""
    info = site / "deepinfer_toy_backend-0.1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deepinfer-toy-backend\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text("[deepinfer.backends]\ntoy = deepinfer_toy_backend.plugin\n")
    return info


@pytest.fixture
def toy_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TOY_SRC))
    yield
    for name in [m for m in sys.modules if m.startswith("deepinfer_toy_backend")]:
        del sys.modules[name]


def test_pluggy_registration_without_entry_points(toy_on_path):
    plugin = importlib.import_module("deepinfer_toy_backend.plugin")
    from deepinfer_toy_backend.backend import ToyBackend

    registry = BackendRegistry(extra_plugins=[plugin])
    assert {"cpu", "toy"} <= set(registry.names())
    assert registry.resolve("toy").name == "toy"
    assert registry.resolve("auto").name != "toy"  # priority -1 never wins `auto` over cpu
    assert registry.resolve("cpu").name == "cpu"  # the device type picks the best backend of that type
    backend = registry.create("toy")
    assert isinstance(backend, ToyBackend)
    assert backend.caps.dtypes and backend.device.type == "cpu"


def test_entry_point_discovery_from_a_dist_info(tmp_path, toy_on_path, monkeypatch):
    write_dist_info(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    registry = BackendRegistry()  # reads installed entry points, as the engine does
    assert "toy" in registry.names()
    assert registry.probe("toy").available
    # without the dist-info the toy backend is unknown, and the error lists what exists
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    importlib.invalidate_caches()
    with pytest.raises(BackendError) as err:
        BackendRegistry().resolve("toy")
    assert "unknown device 'toy'" in str(err.value) and "cpu" in str(err.value)


def test_unavailable_backend_error_lists_reasons(toy_on_path, monkeypatch):
    monkeypatch.setenv("TOY_BACKEND_UNAVAILABLE", "1")
    registry = BackendRegistry(extra_plugins=[importlib.import_module("deepinfer_toy_backend.plugin")])
    with pytest.raises(BackendError) as err:
        registry.resolve("toy")
    msg = str(err.value)
    assert "toy" in msg and "TOY_BACKEND_UNAVAILABLE is set" in msg and "cpu" in msg


# ------------------------------------------------------- engine end to end (subprocess)


@pytest.fixture(scope="module")
def plugin_env(tmp_path_factory):
    """A checkpoint and an environment where the toy backend is 'installed' by entry point."""
    from deepinfer.checkpoints import make_checkpoint

    root = tmp_path_factory.mktemp("toy")
    ckpt = root / "ckpt"
    make_checkpoint("tiny-v2-lite", str(ckpt), seed=0)
    site = root / "site"
    write_dist_info(site)
    env = dict(os.environ)
    env.pop("DEEPINFER_DEVICE", None)
    env.pop("TOY_BACKEND_UNAVAILABLE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(TOY_SRC), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return ckpt, env


ENGINE_SCRIPT = """
import json, os, sys
from deepinfer import DeepInferenceEngine, EngineConfig, SamplingParams
from deepinfer_toy_backend.backend import CALLS

ckpt = sys.argv[1]
prompts = ["Hello", "The quick brown fox", "1 2 3"]
params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
result = {}
for label, device in [("toy", "toy"), ("env", None), ("cpu", "cpu")]:
    if device is None:
        os.environ["DEEPINFER_DEVICE"] = "toy"
    else:
        os.environ.pop("DEEPINFER_DEVICE", None)
    before = sum(CALLS[k] for k in ("rms_norm", "add_rms_norm"))
    engine = DeepInferenceEngine.from_config(
        EngineConfig(model_name_or_path=ckpt, device=device, dtype="float32", max_model_len=128))
    outs = engine.generate(prompts, params, use_tqdm=False)
    result[label] = {
        "backend": engine.backend_name,
        "tokens": [o.token_ids for o in outs],
        "norm_calls": sum(CALLS[k] for k in ("rms_norm", "add_rms_norm")) - before,
        "mla_layers": CALLS["make_mla_attention"],
    }
print(json.dumps(result))
"""


def test_engine_generates_on_third_party_backend(plugin_env):
    ckpt, env = plugin_env
    out = subprocess.run(
        [sys.executable, "-c", ENGINE_SCRIPT, str(ckpt)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["toy"]["backend"] == "toy"
    assert r["env"]["backend"] == "toy"  # DEEPINFER_DEVICE honoured
    assert r["cpu"]["backend"] == "cpu"
    assert r["toy"]["norm_calls"] > 0 and r["env"]["norm_calls"] > 0 and r["toy"]["mla_layers"] > 0
    assert r["cpu"]["norm_calls"] == 0  # the cpu engine did not go through the toy ops
    assert all(len(t) == 6 for t in r["toy"]["tokens"])
    # the toy backend runs the same native math, so greedy tokens agree with cpu
    assert r["toy"]["tokens"] == r["cpu"]["tokens"] == r["env"]["tokens"]


def _cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "deepinfer.entrypoints.cli", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_lists_and_selects_the_plugin(plugin_env):
    ckpt, env = plugin_env
    out = _cli(["backends", "--json"], env)
    assert out.returncode == 0, out.stderr
    toy = {e["name"]: e for e in json.loads(out.stdout)}["toy"]
    assert toy["available"] and toy["reasons"] == []
    assert toy["caps"]["dtypes"] == ["float32"]
    assert toy["op_coverage"]["rms_norm"] == "toy"  # reported by the backend
    assert toy["op_coverage"]["moe"] == "native"

    off = dict(env, TOY_BACKEND_UNAVAILABLE="1")
    out = _cli(["backends"], off)
    assert out.returncode == 0
    assert "toy" in out.stdout and "unavailable: TOY_BACKEND_UNAVAILABLE is set" in out.stdout

    out = _cli(["generate", str(ckpt), "Hi", "--device", "toy", "--max-tokens", "2"], off)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert "no available backend for device 'toy'" in out.stderr and "TOY_BACKEND_UNAVAILABLE" in out.stderr


def test_check_catches_a_wrong_kernel(plugin_env):
    """`deepinfer check --device toy` passes on the toy backend, and exits 1 once its rms_norm is 1% off."""
    _, env = plugin_env
    args = ["check", "--device", "toy", "--op", "rms_norm", "--op", "add_rms_norm", "--no-models", "--json"]
    good = _cli(args, env)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert json.loads(good.stdout)["backend"] == "toy"
    bad = _cli(args, dict(env, TOY_BACKEND_BROKEN="1"))
    assert bad.returncode == 1, bad.stdout[-2000:] + bad.stderr[-2000:]
    report = json.loads(bad.stdout)
    assert not report["ok"]
    statuses = {(r["op"], r["status"]) for r in report["rows"]}
    assert ("rms_norm", "fail") in statuses and ("add_rms_norm", "pass") in statuses
