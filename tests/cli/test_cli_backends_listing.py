"""How `deepinfer backends` derives op coverage from a backend class (in-process, no device)."""

from __future__ import annotations

import torch

from deepinfer.backend import Backend, BackendCaps
from deepinfer.backend.native import NativeOps
from deepinfer.entrypoints.cli_backends import class_op_coverage, merge_coverage


class _Fast(NativeOps, Backend):
    name = "fast"
    caps = BackendCaps()
    device = torch.device("cpu")

    def silu_and_mul(self, x):  # "accelerated"
        return super().silu_and_mul(x)


class _Partial(Backend):  # no NativeOps: everything it lacks is missing
    name = "partial"
    caps = BackendCaps()
    device = torch.device("cpu")

    def rms_norm(self, x, weight, eps):
        return x


def test_class_coverage_names_overrides_and_missing_ops():
    cov = class_op_coverage(_Fast, label="fast")
    assert cov["silu_and_mul"] == "fast"
    assert cov["mla_attention"] == cov["moe"] == cov["linear"] == cov["rms_norm"] == "native"
    partial = class_op_coverage(_Partial)
    assert partial["rms_norm"] == __name__
    assert partial["moe"] == "missing" and partial["route"] == "missing"


def test_merge_prefers_the_backend_report_but_not_a_stale_native_claim():
    from_class = class_op_coverage(_Fast, label="fast")
    from_instance = _Fast().op_coverage()  # NativeOps says "native" for everything
    merged = merge_coverage(from_class, from_instance)
    assert merged["silu_and_mul"] == "fast"  # the class overrides it: not native
    assert merged["linear:fp8_block"] == "native"
    assert merge_coverage(from_class, {**from_instance, "silu_and_mul": "triton"})["silu_and_mul"] == "triton"
