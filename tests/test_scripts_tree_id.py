"""scripts/tree_id.sh names a tree by its files, whatever its .git says: a copy of a newer tree over an older
commit's .git (what the GPU machine holds: files added since look untracked, files deleted since are still in its
index) gets the same id as the newer commit's checkout; another content gets another id; ignored files count not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "tree_id.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def _tree_id(path: Path) -> str:
    out = subprocess.run(["bash", str(SCRIPT), str(path)], check=True, capture_output=True, text=True).stdout.strip()
    assert len(out) == 12 and all(c in "0123456789abcdef" for c in out), out
    return out


def test_a_newer_tree_over_a_stale_git_has_the_newer_commits_id(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    _git(old, "init", "-q")
    (old / ".gitignore").write_text("build/\n")
    (old / "a.py").write_text("a = 1\n")
    (old / "b.py").write_text("b = 1\n")
    _git(old, "add", "-A")
    _git(old, "commit", "-qm", "old")

    new = tmp_path / "new"  # the newer commit's checkout: a.py changed, b.py deleted, c.py added
    shutil.copytree(old, new)
    (new / "a.py").write_text("a = 2\n")
    (new / "b.py").unlink()
    (new / "c.py").write_text("c = 1\n")
    _git(new, "add", "-A")
    _git(new, "commit", "-qm", "new")

    device = tmp_path / "device"  # the newer files over the old .git
    shutil.copytree(old / ".git", device / ".git")
    for f in (".gitignore", "a.py", "c.py"):
        shutil.copy(new / f, device / f)
    (device / "build").mkdir()
    (device / "build" / "scratch.sh").write_text("ignored\n")

    assert _tree_id(device) == _tree_id(new) != _tree_id(old)
    (device / "c.py").write_text("c = 2\n")
    assert _tree_id(device) != _tree_id(new)
