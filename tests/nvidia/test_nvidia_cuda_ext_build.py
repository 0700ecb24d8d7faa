"""How the CUDA C++ extension is found and built: flags, and clear errors when it cannot be."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import ON_GPU

from deepinfer.backends.nvidia import cuda_ext
from deepinfer.errors import BackendError


def test_sources_are_found():
    src = cuda_ext.csrc_dir()
    assert (src / "moe_kernels.cu").exists() and (src / "bindings.cpp").exists()


def test_no_compiler_is_a_clear_error(monkeypatch):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setenv("PATH", "/nonexistent")
    assert not cuda_ext.compiler_available()
    with pytest.raises(BackendError, match="nvcc"):
        cuda_ext._nvcc()


@pytest.mark.skipif(torch.version.cuda is not None, reason="checks the message on a CPU-only torch")
def test_cpu_torch_cannot_build():
    cuda_ext.load.cache_clear()
    with pytest.raises(BackendError, match="has no CUDA"):
        cuda_ext.load()


def test_gencode_always_has_sm90(tmp_path):
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho compute_90 compute_100\n")
    fake.chmod(0o755)
    assert cuda_ext.gencode_flags(str(fake)) == ["-gencode=arch=compute_90,code=sm_90",
                                                 "-gencode=arch=compute_100,code=sm_100"]
    old = tmp_path / "old-nvcc"
    old.write_text("#!/bin/sh\necho compute_80 compute_90\n")
    old.chmod(0o755)
    assert cuda_ext.gencode_flags(str(old)) == ["-gencode=arch=compute_90,code=sm_90"]


@pytest.mark.skipif(ON_GPU, reason="CPU interpreter mode never loads the extension")
def test_interpreter_backend_does_not_load_extension():
    from deepinfer.backends.nvidia.backend import NvidiaBackend

    be = NvidiaBackend(device="cpu")
    assert "cuda" not in be.op_coverage()["route"].split(";")[0]


def test_build_lock_removes_a_lock_file_left_by_a_killed_build(tmp_path, caplog):
    """torch's cpp_extension waits forever on a `lock` file its killed build left; under build_lock (no live
    deepinfer process inside a build) that file is stale and removed, with a warning naming it."""
    import logging

    (tmp_path / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger=cuda_ext.logger.name), cuda_ext.build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()
    assert any("killed before it finished" in r.getMessage() and str(tmp_path / "lock") in r.getMessage()
               for r in caplog.records)


def test_build_lock_waits_for_a_live_build_and_leaves_its_lock_alone(tmp_path):
    """While another holder has the OS lock (a live build: its cpp_extension `lock` file is real), entering waits and
    removes nothing; once the holder lets go (as the OS does when a process dies), it proceeds and clears the file."""
    import fcntl
    import threading
    import time

    (tmp_path / "lock").write_text("")
    # another open file description holds the lock (closed below, mid-test: the release)
    holder = open(tmp_path / "deepinfer_build.flock", "a")  # noqa: SIM115
    fcntl.flock(holder, fcntl.LOCK_EX)
    entered = threading.Event()

    def build():
        with cuda_ext.build_lock(tmp_path):
            entered.set()

    t = threading.Thread(target=build)
    t.start()
    time.sleep(0.3)
    assert not entered.is_set() and (tmp_path / "lock").exists()
    holder.close()  # releases the flock
    t.join(timeout=10)
    assert entered.is_set() and not (tmp_path / "lock").exists()
