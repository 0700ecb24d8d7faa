"""The import rules of docs/architecture.md, checked on the source (AST, no extra dependency).

- the device-agnostic packages (the backend contract, the runtime rooms, the engine, the models
  and the top-level modules) never import a vendor package (triton, torch_npu), a compiled
  extension or deepinfer.backends.*, and never name torch.cuda / torch.npu;
- the contract is the ground floor: it imports no runtime room, model, engine or entry point;
- the runtime rooms never import the models (the engine wires a model in);
- models reach the device only through the contract's public face (plus the host-side table
  builders of backend/native that the allow-list names);
- a backend never imports another backend, imports the contract only through its public face,
  and nothing else imports a backend (the registry finds them through entry points);
- deepinfer/entrypoints import only the public API (ENTRYPOINT_ALLOWED);
- `import deepinfer` pulls in no server or vendor package, and probing every backend
  initialises no device runtime (checked in a fresh interpreter).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "deepinfer"

VENDOR_MODULES = ("triton", "torch_npu", "torch.utils.cpp_extension", "ctypes")
# torch's per-device namespaces: only a backend may name them (the rest reach devices through it)
DEVICE_NAMESPACES = ("torch.cuda", "torch.npu")
# the device-agnostic packages and modules under deepinfer/
AGNOSTIC_DIRS = ("backend", "sched", "kv", "worker", "sample", "text", "engine", "models", "parallel")
AGNOSTIC_MODULES = ("__init__.py", "config.py", "envs.py", "errors.py", "outputs.py", "sampling_params.py")
RUNTIME_ROOMS = ("sched", "kv", "worker", "sample", "text")
# what the contract (deepinfer/backend) may not import: everything above it
ABOVE_CONTRACT = ("deepinfer.sched", "deepinfer.kv", "deepinfer.worker", "deepinfer.sample", "deepinfer.text",
                  "deepinfer.engine", "deepinfer.models", "deepinfer.entrypoints", "deepinfer.conformance",
                  "deepinfer.checkpoints", "deepinfer.config")
# host-side table builders models may take from backend/native (config math, not device ops)
MODEL_NATIVE_ALLOWED = {
    "deepinfer.backend.native.rope": {"rope_cos_sin_cache", "mla_softmax_scale"},
    "deepinfer.backend.native.v4_rope": {"v4_cos_sin", "v4_inv_freq"},
    "deepinfer.backend.native.v4_compressor": {"ring_len"},
}
# deepinfer.* modules a backend may import besides its own package
BACKEND_ALLOWED = ("deepinfer.backend", "deepinfer.errors", "deepinfer.envs")
# deepinfer.* modules the entry points may import: the engine's public API, the checkpoint and
# conformance tools (with their submodules), and the backend registry + contract face for listing
ENTRYPOINT_ALLOWED_TREES = ("deepinfer.conformance", "deepinfer.checkpoints", "deepinfer.entrypoints")
ENTRYPOINT_ALLOWED = (
    "deepinfer",  # the package itself: `from deepinfer import LLM, SamplingParams, ...`
    "deepinfer.config",
    "deepinfer.data",  # the embedded default model's location
    "deepinfer.envs",
    "deepinfer.engine",
    "deepinfer.sampling_params",
    "deepinfer.outputs",
    "deepinfer.errors",
    "deepinfer.backend",
    "deepinfer.backend.registry",
)
# torch.ops namespaces that are part of torch itself; any other one is a compiled extension's
TORCH_OPS_BUILTIN = ("aten", "prims", "quantized", "higher_order", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True)
class Import:
    module: str
    line: int
    names: tuple[str, ...] = ()  # for `from module import a, b`: the names taken


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every module `source` imports: import / from-import (relative ones resolved),
    importlib.import_module("literal") / __import__("literal"), torch.ops.<ns> uses
    (reported as "torch.ops.<ns>") and torch.cuda / torch.npu uses (reported by that name)."""
    found: list[Import] = []
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [Import(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append(Import(target, node.lineno, tuple(a.name for a in node.names)))
            # `from pkg import sub` may import the submodule pkg.sub
            found += [Import(f"{target}.{a.name}", node.lineno) for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Call):
            fn = _dotted(node.func)
            if fn in ("importlib.import_module", "import_module", "__import__") and node.args:
                arg = node.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append(Import(arg.value, node.lineno))
        elif isinstance(node, ast.Attribute):
            name = _dotted(node)
            if name and name.startswith("torch.ops.") and name.count(".") >= 2:
                found.append(Import(".".join(name.split(".")[:3]), node.lineno))
            elif name and any(name == ns or name.startswith(ns + ".") for ns in DEVICE_NAMESPACES):
                found.append(Import(".".join(name.split(".")[:2]), node.lineno))
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _is_module(name: str) -> bool:
    """Whether a dotted deepinfer name is a module or package here (not an attribute of one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _compiled_modules() -> set[str]:
    mods = set()
    for ext in ("*.so", "*.pyd"):
        for path in PKG.rglob(ext):
            parts = list(path.relative_to(ROOT).parts)
            parts[-1] = parts[-1].split(".")[0]
            mods.add(".".join(parts))
    return mods


def agnostic_violation(name: str, compiled: set[str]) -> str | None:
    """Why a device-agnostic module may not import / name `name` (None = fine)."""
    for vendor in VENDOR_MODULES:
        if _under(name, vendor):
            return f"vendor / native-code module {vendor}"
    for ns in DEVICE_NAMESPACES:
        if _under(name, ns):
            return f"{ns} (only a backend names a device runtime)"
    if _under(name, "deepinfer.backends"):
        return "a backend (the runtime and models reach backends only through deepinfer.backend)"
    if any(_under(name, c) for c in compiled) or name.split(".")[-1] in ("_C", "_ext", "_kernels"):
        return "a compiled extension"
    if _under(name, "torch.ops") and name.count(".") == 2 and name.split(".")[2] not in TORCH_OPS_BUILTIN:
        return "a custom op namespace (registered by a compiled extension)"
    return None


def contract_violation(name: str) -> str | None:
    for above in ABOVE_CONTRACT:
        if _under(name, above):
            return f"{above} (the contract is the ground floor)"
    return None


def runtime_violation(name: str) -> str | None:
    if _under(name, "deepinfer.models"):
        return "a model (the engine wires the model into the runtime)"
    return None


def model_violation(imp: Import) -> str | None:
    """Models use the contract's public face; from backend/native only the allowed table builders."""
    name = imp.module
    if _under(name, "deepinfer.backend.native"):
        if not _is_module(name):  # `from deepinfer.backend.native.rope import x` also reports ...rope.x
            return None
        allowed = MODEL_NATIVE_ALLOWED.get(name)
        if allowed is None or not imp.names or not set(imp.names) <= allowed:
            return "a native op (models run ops through the backend; only MODEL_NATIVE_ALLOWED tables)"
        return None
    if _under(name, "deepinfer.backend") and name != "deepinfer.backend" and _is_module(name):
        return "a contract submodule (models import the public face, deepinfer.backend)"
    for room in RUNTIME_ROOMS + ("engine",):
        if _under(name, f"deepinfer.{room}"):
            return f"the runtime room deepinfer.{room}"
    return None


def backend_violation(name: str, own_backend: str, names: tuple[str, ...] = ()) -> str | None:
    """names: what `from name import ...` takes (`from deepinfer import envs` is the module deepinfer.envs)."""
    if name == "deepinfer" and names:
        bad = [n for n in names if f"deepinfer.{n}" not in BACKEND_ALLOWED]
        return f"deepinfer.{bad[0]} (a backend imports the contract's public face)" if bad else None
    if _under(name, "deepinfer.backends") and name.count(".") >= 2:
        other = name.split(".")[2]
        if other != own_backend:
            return f"another backend ({other})"
        return None
    if _under(name, "deepinfer") and not any(name == a for a in BACKEND_ALLOWED) and _is_module(name):
        return "an internal module (a backend imports the contract's public face, deepinfer.backend)"
    return None


def entrypoint_violation(name: str) -> str | None:
    if not _under(name, "deepinfer"):
        return None
    if name in ENTRYPOINT_ALLOWED or any(_under(name, t) for t in ENTRYPOINT_ALLOWED_TREES):
        return None
    # `from deepinfer.engine import LLM` also reports deepinfer.engine.LLM: fine when LLM is a
    # name of an allowed module, not a submodule of it
    parent = name.rpartition(".")[0]
    if parent in ENTRYPOINT_ALLOWED and not _is_module(name):
        return None
    return "an engine internal (entry points use the public API; see docs/architecture.md)"


def _py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (PKG / d).rglob("*.py"))


def _violations(files: list[Path], check, whole: bool = False) -> list[str]:
    """check(path, module name) -> reason | None; whole=True passes the Import itself."""
    out = []
    for path in files:
        module = _module_name(path)
        for imp in imports_of(path.read_text(encoding="utf-8"), module, _is_package(path)):
            why = check(path, imp if whole else imp.module)
            if why:
                out.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}: {why}")
    return out


def _agnostic_files() -> list[Path]:
    return _py_files(*AGNOSTIC_DIRS) + [PKG / m for m in AGNOSTIC_MODULES]


# ------------------------------------------------------------------ the rules


def test_device_agnostic_code_imports_no_vendor_code_backend_or_device_runtime():
    compiled = _compiled_modules()
    files = _agnostic_files()
    assert len(files) > 40, "the device-agnostic packages have no source files?"
    assert _violations(files, lambda p, name: agnostic_violation(name, compiled)) == []


def test_contract_is_the_ground_floor():
    files = _py_files("backend")
    assert files
    assert _violations(files, lambda p, name: contract_violation(name)) == []


def test_runtime_rooms_never_import_models():
    files = _py_files(*RUNTIME_ROOMS)
    assert files
    assert _violations(files, lambda p, name: runtime_violation(name)) == []


def test_models_use_the_contract_face_and_no_native_op():
    files = _py_files("models")
    assert files
    assert _violations(files, lambda p, imp: model_violation(imp), whole=True) == []


def test_backends_never_import_each_other_and_use_the_public_face():
    files = _py_files("backends") + sorted((ROOT / "tests" / "plugins" / "toy_backend").rglob("*.py"))
    assert files

    def check(path: Path, imp: Import):
        if (PKG / "backends") in path.parents:
            rel = path.relative_to(PKG / "backends").parts
            return backend_violation(imp.module, rel[0], imp.names) if len(rel) > 1 else None
        return backend_violation(imp.module, "toy", imp.names)  # the third-party example: the public face only

    assert _violations(files, check, whole=True) == []


def test_backends_are_reached_only_through_the_registry():
    """Nothing outside deepinfer/backends imports a backend: built-in backends are found through
    their entry points exactly as third-party ones are."""
    files = [p for p in PKG.rglob("*.py") if (PKG / "backends") not in p.parents]
    assert _violations(files, lambda p, name: "a backend module" if _under(name, "deepinfer.backends") else None) == []


def test_entrypoints_use_only_the_public_api():
    files = _py_files("entrypoints")
    assert files
    assert _violations(files, lambda p, name: entrypoint_violation(name)) == []


# ------------------------------------------------------------ the checker itself


def test_checker_catches_violations():
    """The rules above must be able to fail: feed them code that breaks each one."""
    src = (
        "import triton.language as tl\n"
        "from torch_npu import npu_format_cast\n"
        "from ..backends.nvidia import kernels\n"
        "import importlib\nimportlib.import_module('deepinfer.backends.cpu.backend')\n"
        "from deepinfer import _C\n"
        "y = torch.ops.deepinfer_cuda.mla_decode(x)\n"
        "z = torch.ops.aten.mm(x, x)\n"
        "g = torch.cuda.CUDAGraph()\n"
        "s = torch.npu.current_stream()\n"
        "import torch, safetensors\n"
    )
    names = [i.module for i in imports_of(src, "deepinfer.worker.model_runner")]
    bad = {n for n in names if agnostic_violation(n, set())}
    assert {"triton.language", "torch_npu", "deepinfer.backends.nvidia", "deepinfer.backends.cpu.backend",
            "deepinfer._C", "torch.ops.deepinfer_cuda", "torch.cuda", "torch.npu"} <= bad
    assert not {"torch", "safetensors", "torch.ops.aten"} & bad

    assert contract_violation("deepinfer.sched.scheduler") and contract_violation("deepinfer.models.base")
    assert contract_violation("deepinfer.errors") is None and contract_violation("deepinfer.backend.specs") is None
    assert runtime_violation("deepinfer.models.registry") and runtime_violation("deepinfer.backend") is None

    model_imports = imports_of("from deepinfer.backend.native.v4_norm import v4_rms_norm\n"
                               "from deepinfer.backend.native.rope import rope_cos_sin_cache\n"
                               "from deepinfer.backend.kv_caches import KVCaches\n"
                               "from deepinfer.sample.sampler import Sampler\n"
                               "from deepinfer.backend import Backend\n", "deepinfer.models.x")
    flagged = {i.module for i in model_imports if model_violation(i)}
    assert {"deepinfer.backend.native.v4_norm", "deepinfer.backend.kv_caches", "deepinfer.sample.sampler"} <= flagged
    assert not {"deepinfer.backend.native.rope", "deepinfer.backend"} & flagged

    assert backend_violation("deepinfer.backends.cpu.backend", "nvidia")
    assert backend_violation("deepinfer.backends.nvidia.rope", "nvidia") is None
    assert backend_violation("deepinfer.backend.native.ops", "nvidia")  # an internal path, not the face
    assert backend_violation("deepinfer.sched.request", "nvidia")
    assert backend_violation("deepinfer.backend", "nvidia") is None
    assert backend_violation("deepinfer", "nvidia", ("envs", "errors")) is None
    assert backend_violation("deepinfer", "nvidia", ("engine",))
    rel = [i.module for i in imports_of("from ..cpu import backend\n", "deepinfer.backends.nvidia.x")]
    assert any(backend_violation(n, "nvidia") for n in rel)

    assert entrypoint_violation("deepinfer.sched.scheduler")
    assert entrypoint_violation("deepinfer.models.registry")
    assert entrypoint_violation("deepinfer.engine.startup")  # the engine package's internals
    assert entrypoint_violation("deepinfer.kv")  # `from deepinfer import kv`
    assert entrypoint_violation("deepinfer.engine") is None
    assert entrypoint_violation("deepinfer.engine.LLM") is None  # `from deepinfer.engine import LLM`
    assert entrypoint_violation("deepinfer.SamplingParams") is None
    assert entrypoint_violation("fastapi") is None


# --------------------------------------------------------- import-time behaviour


def _fresh_python(code: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


HEAVY = ("fastapi", "uvicorn", "starlette", "prometheus_client", "triton", "torch_npu")


def test_import_deepinfer_pulls_no_server_or_vendor_package():
    loaded = _fresh_python(
        "import sys, json, deepinfer\n"
        "from deepinfer import SamplingParams, RequestOutput\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    assert loaded == []


def test_engine_import_and_backend_probing_stay_device_clean():
    """Importing the engine and probing every registered backend loads no vendor
    runtime, no server package, and initialises no CUDA context."""
    result = _fresh_python(
        "import sys, json, torch\n"
        "import deepinfer.engine, deepinfer.config\n"
        "from deepinfer.backend.registry import default_registry\n"
        "probed = default_registry().probe_all()\n"
        f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules],\n"
        "  'cuda_initialized': torch.cuda.is_initialized(), 'names': [p.info.name for p in probed]}))\n"
    )
    assert "cpu" in result["names"]
    assert result["loaded"] == []
    assert result["cuda_initialized"] is False


@pytest.mark.parametrize("module", ["deepinfer.backend", "deepinfer.engine", "deepinfer.worker.model_runner"])
def test_contract_and_runtime_import_without_a_device_runtime(module):
    loaded = _fresh_python(f"import sys, json, {module}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n")
    assert loaded == []
