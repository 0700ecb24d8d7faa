"""scripts/pack_out.sh packs a device call's output folder for the trip back (at most 8 files return): past the
limit every file but summary.txt travels in bundle.tgz, its contents whole (nested folders included); at or under
the limit the folder is left as it is."""

from __future__ import annotations

import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "pack_out.sh"

pytestmark = pytest.mark.skipif(shutil.which("tar") is None, reason="needs tar")


def _fill(out: Path, n: int) -> dict[str, str]:
    files = {f"f{i}.log": f"line {i}\n" for i in range(n - 2)}
    files["trace/b1.json"] = "{}"
    files["summary.txt"] = "[gpu_run] done\n"
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def test_past_the_limit_all_but_the_summary_travel_in_one_bundle(tmp_path):
    files = _fill(tmp_path, 12)
    res = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "8"], check=True, capture_output=True, text=True)
    assert res.stdout.strip() == "12"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "bundle.tgz") as tar:
        members = {m.name.removeprefix("./"): tar.extractfile(m).read().decode() for m in tar if m.isfile()}
    assert members == {k: v for k, v in files.items() if k != "summary.txt"}


def test_at_the_limit_nothing_changes(tmp_path):
    files = _fill(tmp_path, 8)
    subprocess.run(["bash", str(SCRIPT), str(tmp_path), "8"], check=True, capture_output=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()) == sorted(files)
