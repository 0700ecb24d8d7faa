"""The training corpus: the CPython standard library's own .py sources, split by file.

Why the stdlib: it is on every machine that has Python, it is real, well-written code with docstrings, and
its licence (PSF) allows redistribution of a model trained on it. The split is by file, decided by a hash of
the file's path relative to the stdlib root, so it is the same on every machine with the same Python
version and a held-out file never leaks into training.
"""

from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass

HELD_OUT_PERCENT = 5
SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class SourceFile:
    rel_path: str  # relative to the stdlib root, '/'-separated
    text: str


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def is_held_out(rel_path: str) -> bool:
    digest = hashlib.sha256(rel_path.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def stdlib_files(root: str | None = None) -> list[SourceFile]:
    """Every decodable .py file under the stdlib root (site-packages excluded), sorted by path."""
    root = root or stdlib_root()
    out: list[SourceFile] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue  # a handful of test files are deliberately not UTF-8
            if text.strip():
                out.append(SourceFile(rel, text))
    out.sort(key=lambda s: s.rel_path)
    return out


def split(files: list[SourceFile]) -> tuple[list[SourceFile], list[SourceFile]]:
    train = [f for f in files if not is_held_out(f.rel_path)]
    held = [f for f in files if is_held_out(f.rel_path)]
    return train, held


def python_version() -> str:
    return ".".join(map(str, sys.version_info[:3]))
