"""How the CUDA C++ extension is found and built: flags, and clear errors when it cannot be."""

from __future__ import annotations

import pytest
import torch
from nvidia_testutil import ON_GPU  # noqa: I001

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
