"""The import rules of docs/architecture.md, checked on the source (AST, no extra dependency).

- deepinfer/core and deepinfer/models never import a vendor package (triton,
  torch_npu), a compiled extension, or deepinfer.backends.*;
- a backend never imports another backend, and nothing else imports a backend
  (the registry finds them through entry points);
- deepinfer/entrypoints import only the public API (ENTRYPOINT_ALLOWED);
- `import deepinfer` pulls in no server or vendor package, and probing every
  backend initialises no device runtime (checked in a fresh interpreter).
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
# deepinfer.* modules the entry points may import: the engine's public API, the
# checkpoint and conformance tools, and the backend registry + contract for listing.
ENTRYPOINT_ALLOWED = (
    "deepinfer",  # the package itself: `from deepinfer import LLM, SamplingParams, ...`
    "deepinfer.config",
    "deepinfer.engine",
    "deepinfer.sampling_params",
    "deepinfer.outputs",
    "deepinfer.errors",
    "deepinfer.conformance",
    "deepinfer.checkpoints",
    "deepinfer.core.registry",
    "deepinfer.core.backend",
    "deepinfer.entrypoints",
)
# torch.ops namespaces that are part of torch itself; any other one is a compiled extension's
TORCH_OPS_BUILTIN = ("aten", "prims", "quantized", "higher_order", "_c10d_functional", "c10d_functional")


@dataclass(frozen=True)
class Import:
    module: str
    line: int


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
    importlib.import_module("literal") / __import__("literal"), and torch.ops.<ns> uses
    (reported as "torch.ops.<ns>")."""
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
            found.append(Import(target, node.lineno))
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
    return found


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _compiled_modules() -> set[str]:
    mods = set()
    for ext in ("*.so", "*.pyd"):
        for path in PKG.rglob(ext):
            parts = list(path.relative_to(ROOT).parts)
            parts[-1] = parts[-1].split(".")[0]
            mods.add(".".join(parts))
    return mods


def core_violation(name: str, compiled: set[str]) -> str | None:
    """Why `name` may not be imported from deepinfer/core or deepinfer/models (None = fine)."""
    for vendor in VENDOR_MODULES:
        if _under(name, vendor):
            return f"vendor / native-code module {vendor}"
    if _under(name, "deepinfer.backends"):
        return "a backend (core and models talk to backends only through deepinfer.core.backend)"
    if any(_under(name, c) for c in compiled) or name.split(".")[-1] in ("_C", "_ext", "_kernels"):
        return "a compiled extension"
    if _under(name, "torch.ops") and name.count(".") == 2 and name.split(".")[2] not in TORCH_OPS_BUILTIN:
        return "a custom op namespace (registered by a compiled extension)"
    return None


def backend_violation(name: str, own_backend: str) -> str | None:
    if _under(name, "deepinfer.backends") and name.count(".") >= 2:
        other = name.split(".")[2]
        if other != own_backend:
            return f"another backend ({other})"
    return None


def entrypoint_violation(name: str) -> str | None:
    if not _under(name, "deepinfer"):
        return None
    if name == "deepinfer" or any(_under(name, a) for a in ENTRYPOINT_ALLOWED[1:]):
        return None
    # `from deepinfer import X`: fine when X is a public name, not a private submodule
    if name.count(".") == 1 and not (PKG / name.split(".")[1]).exists() and not (PKG / f"{name.split('.')[1]}.py").exists():
        return None
    return "an engine internal (entry points use the public API; see docs/architecture.md)"


def _py_files(*dirs: str) -> list[Path]:
    return sorted(p for d in dirs for p in (PKG / d).rglob("*.py"))


def _violations(files: list[Path], check) -> list[str]:
    out = []
    for path in files:
        module = _module_name(path)
        for imp in imports_of(path.read_text(encoding="utf-8"), module, _is_package(path)):
            why = check(path, imp.module)
            if why:
                out.append(f"{path.relative_to(ROOT)}:{imp.line} imports {imp.module}: {why}")
    return out


# ------------------------------------------------------------------ the rules


def test_core_and_models_import_no_vendor_code_or_backend():
    compiled = _compiled_modules()
    files = _py_files("core", "models")
    assert files, "deepinfer/core and deepinfer/models have no source files?"
    assert _violations(files, lambda p, name: core_violation(name, compiled)) == []


def test_backends_never_import_each_other():
    files = _py_files("backends")
    assert files

    def check(path: Path, name: str):
        rel = path.relative_to(PKG / "backends").parts
        return backend_violation(name, rel[0]) if len(rel) > 1 else None

    assert _violations(files, check) == []


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
        "import torch, safetensors\n"
    )
    names = [i.module for i in imports_of(src, "deepinfer.core.attention")]
    bad = {n for n in names if core_violation(n, set())}
    assert {"triton.language", "torch_npu", "deepinfer.backends.nvidia", "deepinfer.backends.cpu.backend",
            "deepinfer._C", "torch.ops.deepinfer_cuda"} <= bad
    assert not {"torch", "safetensors", "torch.ops.aten"} & bad

    assert backend_violation("deepinfer.backends.cpu.backend", "nvidia")
    assert backend_violation("deepinfer.backends.nvidia.rope", "nvidia") is None
    rel = [i.module for i in imports_of("from ..cpu import backend\n", "deepinfer.backends.nvidia.x")]
    assert any(backend_violation(n, "nvidia") for n in rel)

    assert entrypoint_violation("deepinfer.core.scheduler")
    assert entrypoint_violation("deepinfer.models.registry")
    assert entrypoint_violation("deepinfer.core")  # `from deepinfer import core`
    assert entrypoint_violation("deepinfer.engine") is None
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
        "from deepinfer.core.registry import default_registry\n"
        "probed = default_registry().probe_all()\n"
        f"print(json.dumps({{'loaded': [m for m in {HEAVY!r} if m in sys.modules],\n"
        "  'cuda_initialized': torch.cuda.is_initialized(), 'names': [p.info.name for p in probed]}))\n"
    )
    assert "cpu" in result["names"]
    assert result["loaded"] == []
    assert result["cuda_initialized"] is False
