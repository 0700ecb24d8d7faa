"""Fixtures of the ascend tests: the test-only fake torch_npu, put on sys.path only while a test module
that asks for it runs (and taken off again, so other tests' probes never see it)."""

from __future__ import annotations

import sys

import pytest
from ascend_testutil import FAKE_DIR


@pytest.fixture(scope="module")
def fake_npu():
    sys.path.insert(0, FAKE_DIR)
    import torch_npu

    try:
        yield torch_npu
    finally:
        sys.path.remove(FAKE_DIR)
        for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def ascend(fake_npu):
    from deepinfer.backends.ascend.backend import AscendBackend

    return AscendBackend()
