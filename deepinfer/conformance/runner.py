"""Runs the cases on a backend and on `NativeOps`, and compares them.

Per-dtype tolerances: a row passes when max |out - ref| <= atol + rtol |ref|
elementwise. KV-cache writes must be exact; routing must pick exactly the same
expert set per token (order within a row is free) with fp32-close weights; the
grammar bitmask must give the same bits (-inf included: compare="bitwise").
An op the backend declares unsupported (op_coverage() value starting with
"unsupported", a dtype or quant scheme missing from its caps, or an
UnsupportedOpError / NotImplementedError raised by the op) is reported as
coverage with its reason, not as a failure.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Iterable

import torch

from deepinfer.backend import OP_NAMES, Backend, ForwardBatch, KVCacheSpec, KVLayout, NativeOps
from deepinfer.conformance.cases import Case, cases_for
from deepinfer.conformance.report import ConformanceReport, ConformanceRow
from deepinfer.errors import UnsupportedOpError

DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (atol, rtol) by dtype and case kind. fp32 kernels must not use TF32 here.
TOLERANCES: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.float32: {"elementwise": (1e-5, 1e-5), "layer": (1e-4, 1e-4)},
    torch.bfloat16: {"elementwise": (1.6e-2, 1.6e-2), "layer": (5e-2, 5e-2)},
    torch.float16: {"elementwise": (2e-3, 2e-3), "layer": (1e-2, 1e-2)},
}


class _Reference(NativeOps):
    """The oracle: NativeOps alone, run on the same device as the backend, in the default KV layout."""

    def kv_cache_layout(self, spec: KVCacheSpec) -> KVLayout:
        return KVLayout.single(spec)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def to_device(obj: Any, device: torch.device) -> Any:
    """Moves every tensor in (nested dicts / tuples / lists / ForwardBatch) to `device`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    if isinstance(obj, ForwardBatch):
        return dataclasses.replace(
            obj, **{f.name: to_device(getattr(obj, f.name), device) for f in dataclasses.fields(obj) if f.init}
        )
    return obj


def _unsupported_reason(backend: Backend, case: Case, dtype: torch.dtype, coverage: dict[str, str]) -> str | None:
    """Why the backend will not run this case: op_coverage() says "unsupported: ...", or supports() gives
    reasons for the case's OpSpec (its caps, or what its kernels cannot take)."""
    impl = coverage.get(case.op, "")
    if impl.startswith("unsupported"):
        return impl.partition(":")[2].strip() or "declared unsupported in op_coverage()"
    reasons = backend.supports(case.op_spec(dtype))
    return "; ".join(reasons) if reasons else None


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _compare_bitwise(out: tuple, ref: tuple) -> tuple[bool, float, float, float, float, str]:
    """Same shape, dtype and bits per element (an op that only masks has nothing to round; -inf - -inf is NaN,
    so the value comparison below cannot say it)."""
    for i, (a, b) in enumerate(zip(out, ref)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False, float("nan"), float("nan"), 0.0, 0.0, (f"output {i} is {a.dtype} {tuple(a.shape)}, expected "
                                                                 f"{b.dtype} {tuple(b.shape)}")
        view = _SAME_WIDTH_INT[a.element_size()]
        differ = a.detach().cpu().contiguous().view(view) != b.detach().cpu().contiguous().view(view)
        if bool(differ.any()):
            return False, float("nan"), float("inf"), 0.0, 0.0, f"output {i}: {int(differ.sum())} elements differ bitwise"
    return True, 0.0, 0.0, 0.0, 0.0, ""


def _compare(case: Case, out: tuple, ref: tuple, dtype: torch.dtype) -> tuple[bool, float, float, float, float, str]:
    """(passed, max_abs_err, err_ratio, atol, rtol, reason)."""
    if len(out) != len(ref):
        return False, float("nan"), float("nan"), 0.0, 0.0, f"{len(out)} outputs, expected {len(ref)}"
    if case.compare == "bitwise":
        return _compare_bitwise(out, ref)
    if case.compare == "route":
        (w, ids), (rw, rids) = out, ref
        ids = ids.to(torch.long)
        if ids.shape != rids.shape:
            return False, float("nan"), float("nan"), 0.0, 0.0, f"ids shape {tuple(ids.shape)} != {tuple(rids.shape)}"
        order, rorder = ids.argsort(-1), rids.argsort(-1)
        if not torch.equal(ids.gather(1, order), rids.gather(1, rorder)):
            bad = int((ids.gather(1, order) != rids.gather(1, rorder)).any(-1).sum())
            return False, float("nan"), float("inf"), 0.0, 0.0, f"expert ids differ on {bad} tokens"
        out, ref = (w.float().gather(1, order),), (rw.float().gather(1, rorder),)
        atol, rtol = TOLERANCES[torch.float32]["elementwise"]
    elif case.compare == "exact":
        atol, rtol = 0.0, 0.0
    else:
        atol, rtol = TOLERANCES[dtype][case.kind]
    max_abs, ratio = 0.0, 0.0
    for i, (a, b) in enumerate(zip(out, ref)):
        if a.shape != b.shape:
            return False, float("nan"), float("nan"), atol, rtol, f"output {i} shape {tuple(a.shape)} != {tuple(b.shape)}"
        if a.dtype != b.dtype and case.compare != "route":
            return False, float("nan"), float("nan"), atol, rtol, f"output {i} dtype {a.dtype} != {b.dtype}"
        diff = (a.float() - b.float()).abs()
        if diff.numel() == 0:
            continue
        if not torch.isfinite(a.float()).all() and torch.isfinite(b.float()).all():
            return False, float("inf"), float("inf"), atol, rtol, f"output {i} has non-finite values"
        max_abs = max(max_abs, float(diff.max()))
        if not b.dtype.is_floating_point:  # integers (a draft's id, an index) have nothing to round: exact
            if float(diff.max()) != 0:
                return False, max_abs, float("inf"), atol, rtol, f"output {i} (integers) differs"
            continue
        bound = atol + rtol * b.float().abs()
        ratio = max(ratio, float((diff / bound).max()) if atol or rtol else (0.0 if float(diff.max()) == 0 else float("inf")))
    passed = ratio <= 1.0
    return passed, max_abs, ratio, atol, rtol, "" if passed else f"max error {ratio:.3g}x the tolerance"


def run_conformance(
    backend: Backend,
    *,
    shapes: str = "tiny",
    dtypes: Iterable[torch.dtype] | None = None,
    seed: int = 0,
    ops: Iterable[str] | None = None,
    models: bool | Iterable[str] = False,
) -> ConformanceReport:
    """Compare every op of `backend` with NativeOps on seeded random inputs; returns the report.

    models=True adds end-to-end rows (op "model"): tiny V2/V3/V4 checkpoints run through the
    backend vs through NativeOps (deepinfer.conformance.e2e), at tiny model sizes and in
    fp32 whatever `dtypes` says; a list of preset names picks which.
    """
    want_dtypes = tuple(dtypes) if dtypes is not None else DEFAULT_DTYPES
    want_ops = set(ops) if ops is not None else set(OP_NAMES)
    unknown = want_ops - set(OP_NAMES)
    if unknown:
        raise ValueError(f"unknown op(s) {sorted(unknown)}; known: {', '.join(OP_NAMES)}")
    device = backend.device
    coverage = backend.op_coverage()
    reference = _Reference()
    report = ConformanceReport(backend=backend.name, device=str(device), shapes=shapes, seed=seed)
    for index, case in enumerate(c for c in cases_for(shapes) if c.op in want_ops):
        for dtype in case.dtypes or want_dtypes:
            row = ConformanceRow(op=case.op, case=case.name, dtype=_dtype_name(dtype), status="pass",
                                 impl=backend.op_impl(case.op_spec(dtype)))
            report.rows.append(row)
            reason = _unsupported_reason(backend, case, dtype, coverage)
            if reason is not None:
                row.status, row.reason = "unsupported", reason
                continue
            gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
            inputs = case.make(gen, dtype)
            start = time.perf_counter()
            try:
                out = case.run(backend, to_device(inputs, device))
                backend.synchronize()
            except (UnsupportedOpError, NotImplementedError) as exc:
                row.status, row.reason = "unsupported", f"{type(exc).__name__}: {exc}"
                continue
            except Exception as exc:  # a crash is a result to report, not a reason to stop the suite
                row.status, row.reason = "error", f"{type(exc).__name__}: {exc}"
                continue
            finally:
                row.seconds = time.perf_counter() - start
            ref = case.run(reference, to_device(inputs, device))
            passed, row.max_abs_err, row.err_ratio, row.atol, row.rtol, row.reason = _compare(case, out, ref, dtype)
            row.status = "pass" if passed else "fail"
    if models:
        from deepinfer.conformance.e2e import E2E_PRESETS, run_model_rows

        presets = E2E_PRESETS if models is True else tuple(models)
        run_model_rows(backend, report, seed, presets)
    return report


def run_for_device(
    device: str,
    shapes: str = "tiny",
    dtypes: Iterable[torch.dtype] | None = None,
    seed: int = 0,
    ops: Iterable[str] | None = None,
    models: bool | Iterable[str] = True,
) -> ConformanceReport:
    """`deepinfer check --device X`: resolve X through the backend registry and run the suite
    on it: every op, then (models=True) the end-to-end tiny-model rows."""
    from deepinfer.backend.registry import default_registry

    backend = default_registry().create(device)
    return run_conformance(backend, shapes=shapes, dtypes=dtypes, seed=seed, ops=ops, models=models)
