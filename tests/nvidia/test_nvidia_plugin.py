"""Registration, the context-free probe, caps and op coverage of the nvidia backend."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from nvidia_testutil import ON_GPU, backend  # noqa: I001  (sets TRITON_INTERPRET)


def test_entry_point_registers_nvidia():
    from deepinfer.backend.registry import BackendRegistry

    reg = BackendRegistry()
    assert "nvidia" in reg.names()
    info = reg.probe("nvidia").info
    assert info.device_type == "cuda" and info.priority == 10


@pytest.mark.skipif(ON_GPU, reason="checks the reasons given on a machine without a GPU")
def test_probe_explains_why_unavailable_on_cpu():
    from deepinfer.backends.nvidia.plugin import probe

    reasons = probe()
    assert reasons and any("CUDA" in r or "GPU" in r for r in reasons)


def test_probe_creates_no_cuda_context():
    code = (
        "import torch\n"
        "from deepinfer.backends.nvidia.plugin import probe\n"
        "probe()\n"
        "print(torch.cuda.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_caps_and_coverage():
    be = backend()
    caps = be.caps
    assert torch.bfloat16 in caps.dtypes and 64 in caps.kv_block_sizes
    assert caps.graph_capture == ON_GPU
    cov = be.op_coverage()
    for op in ("rms_norm", "add_rms_norm", "rotary_embedding", "silu_and_mul", "kv_cache_write", "mla_attention"):
        assert cov[op] == "triton"
    assert cov["moe"].startswith(("triton", "cuda"))


@pytest.mark.skipif(ON_GPU, reason="CPU construction is the interpreter mode")
def test_cpu_construction_needs_interpreter(monkeypatch):
    from deepinfer.backends.nvidia.backend import NvidiaBackend
    from deepinfer.errors import BackendError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(BackendError, match="TRITON_INTERPRET"):
        NvidiaBackend(device="cpu")
