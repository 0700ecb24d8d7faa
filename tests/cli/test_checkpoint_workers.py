"""Writing shards in parallel processes gives the same files as one process."""

from __future__ import annotations

import filecmp
import os

from deepinfer.checkpoints import make_checkpoint


def test_parallel_shards_are_byte_identical(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    make_checkpoint("tiny-v2", str(one), seed=3, workers=1)  # tiny-v2 is sharded (1 MiB shards)
    make_checkpoint("tiny-v2", str(two), seed=3, workers=2)
    files = sorted(os.listdir(one))
    assert sum(f.endswith(".safetensors") for f in files) > 1, files
    assert files == sorted(os.listdir(two))
    match, mismatch, errors = filecmp.cmpfiles(one, two, files, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)
