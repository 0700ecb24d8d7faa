"""The packaged conformance suite: passes on `cpu`, lists every op, and catches a wrong or missing op."""

from __future__ import annotations

import dataclasses
import json

import torch

from deepinfer.backend import INT4_ACT_ORDER, MOE_QUANT_SCHEMES, BackendCaps
from deepinfer.backend.native import OP_NAMES
from deepinfer.backends.cpu.backend import CPUBackend
from deepinfer.backends.cpu.ops_moe import CPUMoE
from deepinfer.conformance import run_conformance, run_for_device
from deepinfer.errors import UnsupportedOpError


def test_cpu_passes_and_lists_every_op():
    report = run_for_device("cpu", shapes="tiny", models=False)
    assert report.ok, report.format_table()
    assert report.ops() == sorted(OP_NAMES)
    # the runtime op (decode_rows_meta) is integers only: its cases run at int32 whatever the run's dtypes
    assert {r.dtype for r in report.rows if r.op != "decode_rows_meta"} == {"float32", "bfloat16", "float16"}
    assert {r.dtype for r in report.rows if r.op == "decode_rows_meta"} == {"int32"}
    assert all(r.status == "pass" for r in report.rows)
    data = json.loads(report.to_json())
    assert data["ok"] and data["backend"] == "cpu" and len(data["rows"]) == len(report.rows)
    table = report.format_table()
    for op in OP_NAMES:
        assert op in table


class _WrongNorm(CPUBackend):
    """rms_norm off by a little, silu_and_mul declared unsupported, MoE raising UnsupportedOpError."""

    name = "wrong"

    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, eps) * 1.001

    def make_moe(self, spec):
        raise UnsupportedOpError("no MoE on this test backend")

    def op_coverage(self):
        cov = super().op_coverage()
        cov["silu_and_mul"] = "unsupported: not written yet"
        return cov


def test_suite_catches_wrong_and_reports_unsupported():
    report = run_conformance(_WrongNorm(), dtypes=[torch.float32], ops=["rms_norm", "silu_and_mul", "moe", "route"])
    assert not report.ok
    status = {(r.op, r.status) for r in report.rows}
    assert ("rms_norm", "fail") in status
    assert {r.status for r in report.rows if r.op == "silu_and_mul"} == {"unsupported"}
    assert all("not written yet" in r.reason for r in report.rows if r.op == "silu_and_mul")
    assert {r.status for r in report.rows if r.op == "moe"} == {"unsupported"}
    assert {r.status for r in report.rows if r.op == "route"} == {"pass"}
    assert report.coverage()["moe"] == "unsupported"


class _WrongRouting(CPUBackend):
    name = "wrong-route"

    def route(self, router_logits, spec, correction_bias=None, token_ids=None, tid2eid=None):
        # ignores the correction bias: a classic bug that changes which experts are picked
        bias = None if correction_bias is None else torch.zeros_like(correction_bias)
        return super().route(router_logits, spec, bias, token_ids, tid2eid)

    def kv_cache_write(self, cache, slot_mapping, values):
        super().kv_cache_write(cache, slot_mapping.clamp(min=0), values)  # writes padding rows too


def test_suite_catches_routing_and_cache_write_bugs():
    report = run_conformance(_WrongRouting(), dtypes=[torch.float32], ops=["route", "kv_cache_write"])
    by_case = {r.case: r for r in report.rows}
    assert any(r.status == "fail" and "expert ids differ" in r.reason for r in report.rows if "noaux_tc" in r.case)
    assert all(r.status == "pass" for c, r in by_case.items() if "greedy" in c)
    assert [r.status for r in report.rows if r.op == "kv_cache_write"] == ["fail"]


class _Fp32Only(CPUBackend):
    name = "fp32-only"

    @property
    def caps(self) -> BackendCaps:
        return BackendCaps(dtypes=(torch.float32,), quant_schemes=("none",))


def test_caps_gaps_are_coverage_not_failures():
    report = run_conformance(_Fp32Only(), ops=["linear:none", "linear:fp8_block"])
    assert report.ok, report.format_table()
    fp8 = [r for r in report.rows if r.op == "linear:fp8_block" and r.dtype == "float32"]
    assert fp8 and all(r.status == "unsupported" and "fp8_block" in r.reason for r in fp8)
    assert any(r.status == "pass" for r in report.rows if r.op == "linear:none")
    assert all(r.status == "unsupported" for r in report.rows if r.dtype != "float32")


def test_real_shape_cases_build_and_pass_on_cpu():
    """The GPU uses shapes="real"; build and run the cheap ones here so a broken case is caught in CI.
    (MoE and linear at real widths allocate GBs of weights; they run on the GPU. v4_attention: below.)"""
    ops = ["rms_norm", "rotary_embedding", "kv_cache_write", "route", "mla_attention"]
    report = run_for_device("cpu", shapes="real", dtypes=[torch.float32], ops=ops, models=False)
    assert report.ok, report.format_table()
    assert report.ops() == sorted(ops)


def test_real_shape_v4_attention_cases_build_and_run_on_cpu():
    """Every real-width V4 attention case (V4-Flash: 64 heads of 512; the CSA-select prefix passes 512 entries, so
    its top-512 really selects) builds and runs on the CPU. The CPU backend's v4_attention is NativeOps' own, the
    suite's reference, so the suite would run the same code twice and compare it with itself (~70 s for the
    CSA-select case alone): each case runs once here. scripts/gpu_run.sh's `check --shapes real` compares the
    GPU kernels against the reference at these shapes; the tiny cases compare every op on every backend."""
    from deepinfer.backend.native import NativeOps
    from deepinfer.conformance.cases import cases_for

    backend = CPUBackend()
    assert type(backend).make_v4_attention is NativeOps.make_v4_attention, (
        "the CPU backend has its own v4_attention now: compare it, run_for_device('cpu', shapes='real', "
        "ops=['v4_attention'])")
    cases = [c for c in cases_for("real") if c.op == "v4_attention"]
    assert sorted(c.name.split()[0] for c in cases) == ["csa", "csa-select", "hca", "swa"]
    for index, case in enumerate(cases):
        outs = case.run(backend, case.make(torch.Generator().manual_seed(index), torch.float32))
        assert outs and all(o.dtype == torch.float32 and bool(torch.isfinite(o).all()) for o in outs), case.name


class _ScaledNorm(CPUBackend):
    name = "scaled-norm"

    def rms_norm(self, x, weight, eps):
        return super().rms_norm(x, weight, eps) * 1.001


def test_model_rows_pass_on_cpu_and_catch_a_wrong_op():
    """End-to-end rows: tiny checkpoints through the backend vs NativeOps (teacher-forced logits)."""
    presets = ("tiny-v2-lite", "tiny-v3-fp8")
    good = run_conformance(CPUBackend(), ops=[], dtypes=[torch.float32], models=presets)
    assert good.ok and [r.op for r in good.rows] == ["model", "model"], good.format_table()
    bad = run_conformance(_ScaledNorm(), ops=[], dtypes=[torch.float32], models=presets[:1])
    assert [r.status for r in bad.rows] == ["fail"], bad.format_table()


class _DropsGroups(CPUMoE):
    """Lists INT4_ACT_ORDER (or not) but drops w13_g_idx: a plugin that took int4 experts before the field existed."""

    lists = True

    def quantized_expert_schemes(self) -> tuple[str, ...]:
        return (*MOE_QUANT_SCHEMES, *((INT4_ACT_ORDER,) if self.lists else ()))

    def load_quantized_experts(self, experts) -> None:
        super().load_quantized_experts(dataclasses.replace(experts, w13_g_idx=None))


class _IgnoresActOrder(CPUBackend):
    """Its MoE op is _DropsGroups: the quantized-experts case must catch it where it lists INT4_ACT_ORDER, and report
    the case unsupported where it does not."""

    name = "ignores-act-order"

    def __init__(self, lists: bool):
        super().__init__()
        self.lists = lists

    def make_moe(self, spec):
        op = _DropsGroups(spec, route_fn=self.route, silu_and_mul=self.silu_and_mul,
                          dense_max_work=self.moe_dense_max_work)
        op.lists = self.lists
        return op


def test_suite_catches_an_op_that_ignores_act_order_groups():
    rows = [r for r in run_conformance(_IgnoresActOrder(True), dtypes=[torch.float32], ops=["moe"]).rows
            if "quantized experts" in r.case]
    status = {r.case.split(" T=")[0]: r.status for r in rows}
    assert status["quantized experts int4_gptq act-order"] == "fail", status
    assert status["quantized experts int4_awq"] == "pass" and status["quantized experts fp8_block"] == "pass"
    rows = run_conformance(_IgnoresActOrder(False), dtypes=[torch.float32], ops=["moe"]).rows
    assert {r.status for r in rows if "act-order" in r.case} == {"unsupported"}
