"""`deepinfer backends` (what is registered, usable or not and why) and `deepinfer check`.

Listing probes every backend (a probe never initialises a device runtime).
Op coverage comes from the class alone: for each op of the Backend contract,
which class in the MRO implements it (torch-native from deepinfer.backend.native,
or the backend's own module). Capabilities need an instance, so they are shown
for available backends only: constructing one may touch its device (the nvidia
backend reads the compute capability), which probing never does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "backends",
        help="list backends: available or not and why, capabilities, op coverage",
        description="List every registered backend (built-in and plugins), whether it can run here, and why not.",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=run_backends)

    c = subparsers.add_parser(
        "check",
        help="run the conformance suite on a backend",
        description="Compare a backend's ops with the torch-native reference on random inputs; exit 1 on failure.",
    )
    c.add_argument("--device", default=None, help="backend or device to check (default: $DEEPINFER_DEVICE or auto)")
    c.add_argument("--shapes", choices=["tiny", "real"], default="tiny", help="input sizes (default tiny)")
    c.add_argument(
        "--dtype", action="append", default=None, choices=["float32", "bfloat16", "float16"],
        help="dtype to test (repeatable; default: each the backend supports)",
    )
    c.add_argument("--op", action="append", default=None, help="only this op (repeatable)")
    c.add_argument("--no-models", action="store_true", help="skip the end-to-end tiny-model rows")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--world-size", type=int, default=1, metavar="N",
                   help="N >= 2: spawn N local ranks on a gloo group and check the collectives (all_reduce, "
                        "all_gather, reduce_scatter, all_to_all, broadcast) on every rank, per-rank pass/fail; "
                        "cpu backend only; no model rows (default 1: the one-process suite)")
    c.add_argument("--json", action="store_true", help="machine-readable report")
    c.add_argument("--list-ops", action="store_true",
                   help="print the ops matrix (what each backend runs for every op spec, or why not) and exit")
    c.add_argument("--format", choices=["text", "md", "json"], default="text", help="--list-ops output format")
    c.add_argument("--backends", default=None,
                   help="--list-ops: comma-separated backend names (default: every registered backend)")
    c.set_defaults(run=run_check)


# method of the Backend contract -> op name(s) used by op_coverage() and the conformance suite
_METHOD_OPS = {"make_mla_attention": "mla_attention", "make_moe": "moe", "linear_method": "linear"}


def _op_methods() -> list[str]:
    from deepinfer.backend import Backend

    return sorted(n for n in Backend.__abstractmethods__ if n not in ("caps", "device"))


def class_op_coverage(cls: type, label: str | None = None) -> dict[str, str]:
    """op -> "native" (inherited from deepinfer.backend.native), `label` (default: the module of the
    class that overrides it), or "missing"; read from the class alone, nothing is constructed."""
    coverage = {}
    for method in _op_methods():
        owner = next((k for k in cls.__mro__ if method in vars(k)), None)
        if owner is None or getattr(vars(owner)[method], "__isabstractmethod__", False):
            how = "missing"
        elif owner.__module__.startswith("deepinfer.backend.native"):
            how = "native"
        else:
            how = label or owner.__module__
        coverage[_METHOD_OPS.get(method, method)] = how
    return coverage


def merge_coverage(from_class: dict[str, str], from_instance: dict[str, str]) -> dict[str, str]:
    """The backend's own report, corrected where the class overrides an op it still calls native."""
    merged = dict(from_instance) or dict(from_class)
    for op, how in from_class.items():
        keys = [k for k in merged if k == op or k.startswith(op + ":")] or [op]
        for k in keys:
            if how != "native" and merged.get(k, "native") == "native":
                merged[k] = how
    return merged


def _caps_dict(caps) -> dict:
    def plain(v):
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        return v if isinstance(v, (bool, int, float, str, type(None))) else str(v).removeprefix("torch.")

    return {f.name: plain(getattr(caps, f.name)) for f in dataclasses.fields(caps)}


def describe(probed) -> dict:
    """Everything `deepinfer backends` reports about one probed backend."""
    from deepinfer.backend.registry import load_backend_class

    info = probed.info
    entry = {
        "name": info.name,
        "device_type": info.device_type,
        "priority": info.priority,
        "description": info.description,
        "backend_class": info.backend_class,
        "available": probed.available,
        "reasons": list(probed.reasons),
        "emulation": probed.emulation,  # the stand-in `--device <name>` runs on while unavailable, or None
        "caps": None,
        "op_coverage": None,
    }
    try:
        cls = load_backend_class(info)
    except Exception as exc:  # a broken plugin is reported, not fatal to the listing
        entry["load_error"] = f"{type(exc).__name__}: {exc}"
        return entry
    entry["op_coverage"] = class_op_coverage(cls, label=info.name)
    if probed.available:
        try:
            backend = cls()
            entry["caps"] = _caps_dict(backend.caps)
            entry["op_coverage"] = merge_coverage(entry["op_coverage"], backend.op_coverage() or {})
        except Exception as exc:
            entry["load_error"] = f"cannot construct {info.backend_class}: {type(exc).__name__}: {exc}"
    return entry


def run_backends(args: argparse.Namespace) -> int:
    from deepinfer.backend.registry import default_registry

    probed = default_registry().probe_all()
    entries = [describe(p) for p in probed]
    if args.json:
        print(json.dumps(entries, indent=2))
        return 0
    for p, e in zip(probed, entries):
        print(f"{e['name']}  (device {e['device_type']}, priority {e['priority']}): {p.state()}")
        if e["description"]:
            print(f"  {e['description']}")
        print(f"  class: {e['backend_class']}")
        if "load_error" in e:
            print(f"  load error: {e['load_error']}")
        if e["caps"] is not None:
            caps = ", ".join(f"{k}={_fmt(v)}" for k, v in e["caps"].items())
            print(f"  caps: {caps}")
        if e["op_coverage"] is not None:
            ops = ", ".join(f"{op}={how}" for op, how in e["op_coverage"].items())
            print(f"  ops: {ops}")
    if not entries:
        print("no backends registered (is deepinfer installed? `pip install -e .`)", file=sys.stderr)
        return 1
    return 0


def _fmt(v) -> str:
    return "|".join(map(str, v)) if isinstance(v, list) else str(v)


def run_check(args: argparse.Namespace) -> int:
    if args.list_ops and args.world_size != 1:
        print("deepinfer: error: --list-ops and --world-size do not go together", file=sys.stderr)
        return 2
    if args.list_ops:
        from deepinfer.conformance.ops_matrix import RENDERERS, build_matrix

        names = [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends else None
        rows, columns = build_matrix(names)
        sys.stdout.write(RENDERERS[args.format](rows, columns))
        return 0
    if args.backends or args.format != "text":
        print("deepinfer: error: --backends and --format go with --list-ops", file=sys.stderr)
        return 2
    import torch

    from deepinfer.backend.registry import requested_device
    from deepinfer.conformance import run_for_device

    dtypes = [getattr(torch, name) for name in args.dtype] if args.dtype else None
    if args.world_size != 1:
        return _run_check_ranks(args, requested_device(args.device), dtypes)
    report = run_for_device(
        requested_device(args.device), shapes=args.shapes, dtypes=dtypes, seed=args.seed, ops=args.op,
        models=not args.no_models,
    )
    if args.json:
        print(report.to_json())
    else:
        print(report.format_table())
    return 0 if report.ok else 1


def _run_check_ranks(args: argparse.Namespace, device: str, dtypes) -> int:
    """`deepinfer check --world-size N`: the collectives on N local gloo ranks (conformance/collectives.py)."""
    from deepinfer.backend import COLLECTIVE_OPS
    from deepinfer.conformance.collectives import run_collectives

    if args.world_size < 1:
        print(f"deepinfer: error: --world-size must be >= 1 (got {args.world_size})", file=sys.stderr)
        return 2
    others = sorted(set(args.op or ()) - set(COLLECTIVE_OPS))
    if others:
        print(f"deepinfer: error: --world-size checks the collectives only ({', '.join(COLLECTIVE_OPS)}); "
              f"--op {', '.join(others)} runs in the one-process suite (--world-size 1)", file=sys.stderr)
        return 2
    report = run_collectives(device, args.world_size, seed=args.seed, dtypes=dtypes, shapes=args.shapes,
                             ops=args.op)
    print(report.to_json() if args.json else report.format_table())
    return 0 if report.ok else 1
