"""The CUDA C++ kernels of csrc/cuda compile for sm_90 with this machine's nvcc (no GPU needed), every kernel
without register spills: the GPU machine builds them at first use, so a compile error or a spill introduced by an
edit shows here first. Skipped where no nvcc is found."""

from __future__ import annotations

import re
import subprocess

import pytest
from nvidia_testutil import ON_GPU  # noqa: F401  (sets TRITON_INTERPRET on the CPU)

from deepinfer.backends.nvidia import cuda_ext
from deepinfer.errors import BackendError

# kernels each source instantiates: int4_gemv.cu's dense GEMV (4 and 8 warps), gate_up (four K splits: 1, 2, 4, 8)
# and down (three: 1, 2, 4) x {bf16, fp16} x {fp16, fp32 scales}
KERNELS = {"int4_gemv.cu": 36, "moe_kernels.cu": 2}


def _nvcc() -> str | None:
    try:
        return cuda_ext._nvcc()
    except BackendError:
        return None


@pytest.mark.parametrize("source", sorted(KERNELS))
def test_cuda_source_compiles_for_sm90_without_spills(source, tmp_path):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    src = cuda_ext.csrc_dir()
    res = subprocess.run([nvcc, "-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-Xptxas", "-v",
                          f"-I{src}", "-c", str(src / source), "-o", str(tmp_path / "k.o")],
                         check=False, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    entries = re.findall(r"Compiling entry function '([^']+)'", res.stderr)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", res.stderr)
    assert len(entries) == KERNELS[source] and len(spills) == len(entries), res.stderr[-4000:]
    assert all(int(st) == 0 and int(ld) == 0 for st, ld in spills), res.stderr[-4000:]
