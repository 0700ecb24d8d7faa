"""A built wheel carries the CUDA C++ sources (csrc/cuda as deepinfer/_csrc/cuda) and the LICENSE, and
cuda_ext.csrc_dir() finds the packaged copy in a wheel install. CPU-only: nothing is compiled."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from deepinfer.backends.nvidia import cuda_ext
from deepinfer.data import EMBEDDED_MODEL_FILES, EMBEDDED_MODEL_NAME
from deepinfer.errors import BackendError

REPO = Path(__file__).resolve().parents[2]
CSRC_FILES = sorted(p.name for p in (REPO / "csrc" / "cuda").iterdir() if p.suffix in (".cu", ".cuh", ".h", ".cpp"))


def _pip(*args: str, cwd: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel of a copy of the checkout: an in-tree build writes build/ and *.egg-info next to the sources,
    and files left in an old build/lib end up in the next wheel, so the shared checkout is not built in place."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".gpu", ".ckpt", ".venv", ".whl", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
        "tests", "benchmarks"))
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(tmp / "dist"), str(src), cwd=tmp)
    (whl,) = (tmp / "dist").glob("deepinfer-*.whl")
    return whl


def test_wheel_lists_the_cuda_sources_the_embedded_model_and_the_license(wheel):
    assert {"bindings.cpp", "moe_kernels.cu", "moe_kernels.h"} <= set(CSRC_FILES)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        packaged = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("deepinfer/_csrc/cuda/"))
        assert packaged == CSRC_FILES, names
        embedded = {n.rsplit("/", 1)[1]: zf.getinfo(n).file_size for n in names
                    if n.startswith(f"deepinfer/data/{EMBEDDED_MODEL_NAME}/")}
        assert set(embedded) == set(EMBEDDED_MODEL_FILES), names
        here = REPO / "deepinfer" / "data" / EMBEDDED_MODEL_NAME
        assert embedded == {f: (here / f).stat().st_size for f in EMBEDDED_MODEL_FILES}
        licenses = [n for n in names if ".dist-info/" in n and n.rsplit("/", 1)[1] == "LICENSE"]
        assert licenses, names
        assert zf.read(licenses[0]) == (REPO / "LICENSE").read_bytes()
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "Apache License" in (REPO / "LICENSE").read_text()
    assert "License :: OSI Approved :: Apache Software License" in meta
    assert "DeepInfer developers" in meta and "Project-URL: Source" in meta, meta[:2000]


def test_wheel_install_finds_the_packaged_sources(wheel, tmp_path):
    site = tmp_path / "site"
    _pip("install", "--no-deps", "--no-cache-dir", "--target", str(site), str(wheel), cwd=tmp_path)
    code = (
        "import deepinfer\n"
        "from deepinfer.backends.nvidia import cuda_ext\n"
        "from deepinfer.data import embedded_model_path\n"
        "print(deepinfer.__file__)\n"
        "print(cuda_ext.csrc_dir())\n"
        "print(embedded_model_path())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    # cwd outside the checkout: `python -c` puts the cwd first on sys.path
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    package_file, src, model = (Path(line) for line in out.stdout.split())
    assert model == site / "deepinfer" / "data" / EMBEDDED_MODEL_NAME and (model / "model.safetensors").is_file()
    assert package_file.is_relative_to(site), package_file
    assert src.is_relative_to(site) and src == site / "deepinfer" / "_csrc" / "cuda", src
    assert sorted(p.name for p in src.iterdir()) == CSRC_FILES
    assert (src / "moe_kernels.cu").is_file()


def test_checkout_sources_when_not_packaged(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_ext, "_packaged_csrc", lambda: tmp_path / "absent")
    assert cuda_ext.csrc_dir() == REPO / "csrc" / "cuda"


def test_no_sources_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(cuda_ext, "_packaged_csrc", lambda: tmp_path / "pkg")
    monkeypatch.setattr(cuda_ext, "_checkout_csrc", lambda: tmp_path / "checkout")
    with pytest.raises(BackendError) as err:
        cuda_ext.csrc_dir()
    assert str(tmp_path / "pkg") in str(err.value) and str(tmp_path / "checkout") in str(err.value)
